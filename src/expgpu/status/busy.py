"""One live run per run dir, one live sweep per sweep dir. A second run started in the dir of a run still in
progress (a fixed hydra.run.dir given twice, in two terminals) would resume its checkpoint while it trains on,
and both would overwrite each other's checkpoint, metrics and result; a second sweep in a live sweep's dir
would do the same to every job, and to the study and pool.json. Either is refused in one line instead, before
it writes anything there:

- RunDirGuard, a Hydra callback (conf/config.yaml, hydra.callbacks.run_dir): at the start of a single run,
  before Hydra saves its .hydra/*.yaml and opens its log there; at the start of a sweep, before the sweeper
  writes in the sweep dir (whose process is recorded as a run's: SWEEP_DIR/.expgpu/process.json);
- every job as it starts (expgpu.app), under any launcher: checked before anything is read there, then,
  unless it is a dry run or finished already, claimed (claim: the check and the record written under a lock,
  so that two started at once cannot both pass).

The callback also makes the dir first (made): where it cannot be made, Hydra would die in a traceback.

What tells: the process record (.expgpu/process.json, expgpu.results.write_process) names a process that still
runs on this host, or, written on another host, a SLURM job other than this process's that squeue still lists
(its own job, requeued, resumes its own run). Any other record from another host cannot be checked from here
(expgpu status calls such a run lost once its files are quiet for 10 minutes; a requeued job must not wait
that long): it does not refuse. Under slurm_pool the sweep runs inside the allocation, where the same command (on
gpu_pool) checks and records it; its launcher refuses a second sweep while the allocation is queued
(expgpu.slurm.sweep_job.refuse_live).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

_ELSEWHERE = ("hydra_plugins.expgpu_launchers.slurm_pool.SlurmPoolLauncher",)
CLAIM_WAIT_S = 10.0   # the most a claim waits for another's to end (each holds the lock for milliseconds)


def refuse_busy(where: Path, what: str = "run", key: str = "hydra.run.dir") -> None:
    """A UserError (RunDirBusy) when another process is in charge of a run (or sweep) in `where` and still runs:
    on this host, by its pid; on another, when it belongs to a SLURM job other than this one that is still in
    SLURM's queue. This process itself, or one it descends from, is the same run."""
    from expgpu.results import read_process

    record = read_process(where)
    if record is None:   # a new run dir: no more to import or ask (~15 ms of every run's start)
        return
    from expgpu.status.read import lives

    alive = lives(record)
    job = _queued_elsewhere(record) if alive is None else None
    if not alive and job is None:
        return
    import psutil

    from expgpu.errors import RunDirBusy

    me = psutil.Process()
    if alive and record["pid"] in {me.pid, *(p.pid for p in me.parents())}:
        return
    since = datetime.datetime.fromtimestamp(float(record.get("started") or record.get("created") or 0))
    raise RunDirBusy(f"{where}: a {what} is in progress there ({job + ', ' if job else ''}pid {record['pid']} on "
                     f"{record['host']}, since {since:%Y-%m-%d %H:%M:%S}); two in one dir would overwrite each other's "
                     f"checkpoints and files: wait for it to end, stop it, or give this {what} another {key}"
                     f"{' (a sweep job: hydra.sweep.subdir, each job its own)' if what == 'run' else ''}")


def _queued_elsewhere(record: dict) -> str | None:
    """'SLURM job J, STATE' where the record's process (on another host) belongs to a SLURM job other than this
    process's that squeue still lists (running, or requeued to run there again); None where it has left the
    queue, belongs to no SLURM job, or squeue cannot say (as before: not refused)."""
    from expgpu.results import slurm_job
    from expgpu.status import queue

    job = record.get("job")
    if not job or str(job) == slurm_job():
        return None
    state = (queue.states([str(job)]) or {}).get(str(job))
    return f"SLURM job {job}, {state}" if state else None


def claim(where: Path, what: str = "run", key: str = "hydra.run.dir") -> None:
    """This process is in charge of `where` from now on (its process record, expgpu.results.write_process), unless
    another live one is (RunDirBusy): checked and written under a lock, so that of two runs started at once (two
    jobs given one dir by a sweep's subdir pattern) one is refused, not both let in."""
    from expgpu.results import write_process

    with _claim_lock(where):
        refuse_busy(where, what, key)
        write_process(where)


@contextlib.contextmanager
def _claim_lock(where: Path):
    """flock on .expgpu/process.lock for the few milliseconds of a claim. Where the file system has no flock, or a
    holder does not let go (its node gone mid-claim), the claim goes on unlocked: the record check still runs."""
    from expgpu import rundir

    path = rundir.state_dir(where) / "process.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            except OSError:
                break
        yield
    finally:
        os.close(fd)


class RunDirGuard(Callback):
    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        from expgpu import ranks
        from expgpu.errors import exit_on_user_error

        with exit_on_user_error():
            run_dir = made(config, "hydra.run.dir")
            if ranks.detect().rank == 0:   # the others share its run dir: its record is theirs
                refuse_busy(run_dir)   # only checked: the job claims it (expgpu.app), once it is sure to run

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from expgpu import rundir
        from expgpu.errors import exit_on_user_error, record_in

        with exit_on_user_error():
            sweep = made(config, "hydra.sweep.dir")
            if OmegaConf.select(config, "hydra.launcher._target_", default=None) not in _ELSEWHERE:
                claim(sweep, "sweep", "hydra.sweep.dir")
                # a user error that ends this sweep is recorded in it (expgpu status: why it ended); an earlier
                # attempt's record is not this one's
                rundir.job_failure_file(sweep).unlink(missing_ok=True)
                record_in(sweep)


def made(config: Any, key: str) -> Path:
    """The dir `key` names, made now, as Hydra would make it next: where it cannot be (a file on its path, no
    permission, a read-only file system), one line naming the key, not Hydra's traceback. Hydra calls a callback
    inside a guard of its own that turns an exception into a warning: a UserError leaves it as SystemExit."""
    from omegaconf.errors import OmegaConfBaseException

    from expgpu.errors import UserError, first_line

    try:
        where = Path(str(OmegaConf.select(config, key))).absolute()
    except OmegaConfBaseException as e:   # the default dir's resolver could not claim one (expgpu.rundir)
        raise UserError(f"{key}: {first_line(e)}") from None
    try:
        where.mkdir(parents=True, exist_ok=True)
        if not os.access(where, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        raise UserError(f"{key}={where}: cannot make it or write there ({e.strerror}); give a directory this user "
                        "can write") from None
    return where
