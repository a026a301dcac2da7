"""Where the study lives, reachable from every job: the sweeper's and every trial's process open it.

`storage: null` (the default) is an Optuna journal file in the sweep dir, SWEEP_DIR/optuna.journal:
appends under a lock file, safe on a shared file system, so SLURM jobs on other nodes report to it.
A string with "://" is any Optuna storage URL (sqlite:///study.db, postgresql://..., mysql://...);
any other string is a journal file at that path.
"""

from __future__ import annotations

from pathlib import Path

from expgpu.errors import UserError, one_line

JOURNAL = "optuna.journal"


def spelled(storage: str | None, sweep_dir: Path) -> str:
    """The storage as every process spells it: a URL, or a journal file's absolute path."""
    if storage is None:
        return str((Path(sweep_dir) / JOURNAL).absolute())
    if not isinstance(storage, str) or not storage.strip():
        raise UserError(f"hydra.sweeper.storage={storage!r} is not allowed: null (a journal file in the sweep "
                        "dir), an Optuna storage URL such as sqlite:///study.db, or a journal file's path")
    return storage if "://" in storage else str(Path(storage).expanduser().absolute())


def open_storage(where: str):
    """The Optuna storage `where` names (spelled()); one line naming it when it cannot be opened."""
    import optuna

    try:
        if "://" in where:
            return optuna.storages.get_storage(where)
        from optuna.storages.journal import JournalFileBackend

        Path(where).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(where))
    except Exception as e:
        raise UserError(f"hydra.sweeper.storage={where}: cannot be opened ({one_line(e)}); give an Optuna "
                        "storage URL such as sqlite:///study.db, or null for a journal file in the sweep dir") from None
