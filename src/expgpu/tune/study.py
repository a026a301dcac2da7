"""The study: opened (or continued, in a rerun of the sweep dir), its trials told how their jobs
ended, and two files for people and the report: SWEEP_DIR/study.json (every trial: state, params,
values, the step a pruned one stopped at, why a failed one failed, its job dir), rewritten after each
tell, and optimization_results.yaml at the end (best_params / best_value, as Hydra's optuna sweeper).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from expgpu.errors import UserError
from expgpu.rundir import STATE, STUDY, atomic_write_bytes
from expgpu.tune import storage
from expgpu.tune.settings import Settings, build

log = logging.getLogger("expgpu")

# User attributes a trial carries, so that a rerun of the sweep finds its job again.
JOB_DIR, OVERRIDES, REASON = "expgpu_job_dir", "expgpu_overrides", "expgpu_failure"


def trial_file(sweep_dir: Path, number: int) -> Path:
    """What attaches trial `number`'s job to it (bridge.py reads it; its path is the job's TRIAL_ENV)."""
    return Path(sweep_dir).absolute() / STATE / f"trial-{number}.json"


def open_study(s: Settings, sweep_dir: Path, sampler):
    """(the study, where it is stored), created or continued, with `sampler` (None: Optuna's
    default); a study of that name with other directions is one line."""
    import optuna

    where = storage.spelled(s.storage, sweep_dir)
    st = storage.open_storage(where)
    name = s.study_name or str(sweep_dir)
    pruner = build(s.pruner, "pruner") or optuna.pruners.NopPruner()
    try:
        study = optuna.load_study(study_name=name, storage=st, sampler=sampler, pruner=pruner)
    except KeyError:
        study = optuna.create_study(study_name=name, storage=st, sampler=sampler, pruner=pruner,
                                    directions=list(s.directions))
        return study, where
    have = [d.name.lower() for d in study.directions]
    if have != list(s.directions):
        raise UserError(f"hydra.sweeper.study_name={name}: the study in {where} exists with direction {have}, "
                        f"not {list(s.directions)}; give another study_name (or sweep dir), or its directions")
    return study, where


def attach(study, trial, sweep_dir: Path, where: str, s: Settings, overrides: list[str]) -> Path:
    """Write the trial's file, before its job starts, and note the job's overrides on the trial (a
    rerun starts it again with them); the file's path (the job's TRIAL_ENV). The file holds the
    trial's parameters too: the job checks that it composed them (check.py)."""
    trial.set_user_attr(OVERRIDES, list(overrides))
    path = trial_file(sweep_dir, trial.number)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"storage": where, "study": study.study_name, "trial_id": trial._trial_id, "number": trial.number,
           "objective": s.metric, "pruner": s.pruner, "params": trial.params}
    atomic_write_bytes(path, json.dumps(doc).encode())
    return path


def tell(study, trial, state: str, values: list[float] | None = None, reason: str = "") -> None:
    """COMPLETE with its values, PRUNED (Optuna keeps its last reported value), or FAIL with its reason."""
    from optuna.trial import TrialState

    if reason:
        trial.set_user_attr(REASON, reason[:500])
    try:
        study.tell(trial, values=values if state == "COMPLETE" else None, state=TrialState[state],
                   skip_if_finished=True)
    except RuntimeError as e:
        # GridSampler calls study.stop() once its grid is covered, which Optuna only allows inside
        # optimize(): the tell itself is stored by then, and the grid's end is a normal end.
        if "Study.stop" not in str(e):
            raise


def summary(study, s: Settings) -> dict:
    """study.json's content: the study and every trial, as the report reads them (no Optuna there)."""
    trials = []
    for t in study.get_trials(deepcopy=False):
        steps = sorted(t.intermediate_values)
        trials.append({"number": t.number, "state": t.state.name, "params": t.params, "values": t.values,
                       "last_step": steps[-1] if steps else None,
                       "last_value": t.intermediate_values[steps[-1]] if steps else None,
                       "job_dir": t.user_attrs.get(JOB_DIR), "overrides": t.user_attrs.get(OVERRIDES),
                       "reason": t.user_attrs.get(REASON),
                       "start": t.datetime_start.timestamp() if t.datetime_start else None,
                       "end": t.datetime_complete.timestamp() if t.datetime_complete else None})
    return {"study": study.study_name, "objective": list(s.objective or ()), "directions": list(s.directions),
            "pruner": (s.pruner or {}).get("_target_"), "sampler": (s.sampler or {}).get("_target_"),
            "n_trials": s.n_trials, "trials": trials}


def write_summary(study, s: Settings, sweep_dir: Path) -> None:
    atomic_write_bytes(Path(sweep_dir) / STUDY, (json.dumps(summary(study, s), indent=1) + "\n").encode())


def write_results(study, sweep_dir: Path) -> dict[str, Any] | None:
    """optimization_results.yaml, as Hydra's optuna sweeper writes it; None when no trial completed."""
    from omegaconf import OmegaConf
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return None
    if len(study.directions) == 1:
        best = study.best_trial
        doc = {"name": "optuna", "best_params": best.params, "best_value": best.value}
    else:
        doc = {"name": "optuna", "solutions": [{"params": t.params, "values": t.values} for t in study.best_trials]}
    atomic_write_bytes(Path(sweep_dir) / "optimization_results.yaml", OmegaConf.to_yaml(OmegaConf.create(doc)).encode())
    return doc
