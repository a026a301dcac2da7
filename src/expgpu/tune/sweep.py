"""The sweeper's loop: ask the study for a trial the moment a slot is free, start its job, wait for
any job to end, tell the study how it ended; until n_trials trials (all of the study's, whatever
their state, so a rerun of the sweep dir counts what it finds) have ended.

A rerun of the same sweep dir (hydra.sweep.dir=...) continues the study: finished, pruned and failed
trials are kept, and a trial still RUNNING in it (its sweeper died: Ctrl-C, a node lost, the sweeping
job's time limit) is started again in its own job dir, where expgpu resumes it from its checkpoint.
"""

from __future__ import annotations

import logging
import shlex
import time
from pathlib import Path

from expgpu.errors import Stopped, UserError, one_line
from expgpu.tune import TRIAL_ENV
from expgpu.tune import study as studies
from expgpu.tune.runners import Runner
from expgpu.tune.settings import Settings
from expgpu.tune.space import Space

log = logging.getLogger("expgpu")

WAIT_S = 1.0   # a wait for any job to end returns at least this often (stop requests are checked)


class Sweep:
    def __init__(self, s: Settings, space: Space, study, where: str, runner: Runner, sweep_dir: Path, cfg):
        self.s, self.space, self.study, self.where, self.runner = s, space, study, where, runner
        self.sweep_dir, self.cfg = Path(sweep_dir), cfg
        self.active: dict[int, object] = {}   # job number -> the trial it runs
        self.warned_unlogged = False
        self._stop_sent = False

    def run(self) -> None:
        from optuna.trial import TrialState

        resumed = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if _under(t.user_attrs.get(studies.JOB_DIR), self.sweep_dir)]
        ended = len(self.study.get_trials(deepcopy=False)) - len(resumed)
        if ended or resumed:
            log.info("study %s: %d trial(s) kept, %d resumed from their job dirs, %d to go", self.study.study_name,
                     ended, len(resumed), max(0, self.s.n_trials - ended - len(resumed)))
        try:
            from optuna.trial import Trial

            for frozen in resumed:   # Optuna's handle on a trial asked by an earlier sweeper process
                self._start(Trial(self.study, frozen._trial_id), frozen.user_attrs[studies.OVERRIDES])
            self._loop()
        finally:
            self.runner.close()
            studies.write_summary(self.study, self.s, self.sweep_dir)
        if self.runner.stopping():
            log.warning("sweep stopped: %d trial(s) saved as they were; rerun the same command with "
                        "hydra.sweep.dir=%s to continue the study", len(self.active), self.sweep_dir)
            raise KeyboardInterrupt
        self._finish()

    def _loop(self) -> None:
        while True:
            if not self.runner.stopping():
                self._fill()
            if not self.active:
                return
            for num, ret in self.runner.wait(WAIT_S):
                self._ended(num, ret)
            if self.runner.stopping():
                if not self.runner.busy():   # what was queued never started: it stays RUNNING for a rerun
                    return
                if not self._stop_sent:
                    self._stop_sent = True
                    self.runner.stop()

    def _fill(self) -> None:
        """Trials started until every slot is busy (and `ahead` more wait, ready), or n_trials are."""
        total = len(self.study.get_trials(deepcopy=False))
        if hasattr(self.runner, "expect"):
            self.runner.expect(self.s.n_trials - total)
        room = self.runner.capacity + self.runner.ahead - len(self.active)
        for _ in range(max(0, min(room, self.s.n_trials - total))):
            trial = self.study.ask(self.space.distributions)
            if self.s.custom_search_space:
                from hydra.utils import get_method

                get_method(self.s.custom_search_space)(self.cfg, trial)
            self._start(trial, self.space.overrides(trial.params))

    def _start(self, trial, overrides: list[str]) -> None:
        path = studies.attach(self.study, trial, self.sweep_dir, self.where, self.s, overrides)
        job_dir = self.runner.submit(overrides + [f"++hydra.job.env_set.{TRIAL_ENV}={shlex.quote(str(path))}"],
                                     trial.number)
        trial.set_user_attr(studies.JOB_DIR, str(Path(job_dir).absolute()))
        self.active[trial.number] = trial

    def _ended(self, num: int, ret) -> None:
        trial = self.active.pop(num)
        state, values, reason = outcome(ret, len(self.s.objective))
        if state == "STOPPED" or (state == "FAIL" and self.runner.stopping()):
            return   # the sweeper is stopping: the trial stays RUNNING, and a rerun resumes it
        if state == "USER_ERROR":
            studies.tell(self.study, trial, "FAIL", reason=reason)
            self.runner.stop()
            self._drain()
            raise UserError(f"trial {num}: {reason}")
        studies.tell(self.study, trial, state, values, reason)
        shown = {"COMPLETE": lambda: f"{', '.join(f'{v:.6g}' for v in values)}",
                 "PRUNED": lambda: "pruned", "FAIL": lambda: f"failed: {reason}"}[state]()
        log.info("trial %d: %s (%s)", num, shown, " ".join(f"{k}={v}" for k, v in trial.params.items()))
        if state == "COMPLETE" and self.s.pruner and not self.warned_unlogged:
            self._check_logged(num)
        studies.write_summary(self.study, self.s, self.sweep_dir)

    def _check_logged(self, num: int) -> None:
        """A pruner that was never told anything prunes nothing: say so after the first trial."""
        self.warned_unlogged = True
        frozen = self.study.get_trials(deepcopy=False)[num] if num < len(self.study.trials) else None
        if frozen is not None and frozen.number == num and not frozen.intermediate_values:
            log.warning("hydra.sweeper.pruner: trial %d never logged %s with run.log, so the pruner has nothing to "
                        "go on and prunes no trial; log it where you evaluate (run.log(%s=...))", num,
                        self.s.objective[0], self.s.objective[0])

    def _drain(self) -> None:
        """Wait for the stopped trials' jobs to end (they save); they stay RUNNING for a rerun."""
        deadline = time.monotonic() + 120
        while self.active and self.runner.busy() and time.monotonic() < deadline:
            for num, _ in self.runner.wait(WAIT_S):
                self.active.pop(num, None)

    def _finish(self) -> None:
        doc = studies.write_results(self.study, self.sweep_dir)
        if doc is None:
            log.warning("study %s: no trial completed", self.study.study_name)
        elif "best_value" in doc:
            log.info("best: %s=%g with %s", self.s.objective[0], doc["best_value"],
                     " ".join(f"{k}={v}" for k, v in doc["best_params"].items()))
        else:
            log.info("Pareto front: %d trial(s)", len(doc["solutions"]))


def outcome(ret, n_objectives: int) -> tuple[str, list[float] | None, str]:
    """(COMPLETE | PRUNED | FAIL | STOPPED | USER_ERROR, values, reason) of a job's JobReturn."""
    from hydra.core.utils import JobStatus

    if ret.status is not JobStatus.COMPLETED:
        err = ret._return_value
        cause = err
        while cause is not None and not isinstance(cause, (UserError, Stopped)):
            cause = cause.__cause__
        if isinstance(cause, UserError):
            return "USER_ERROR", None, str(cause)
        if isinstance(cause, Stopped):
            return "STOPPED", None, str(err)
        return "FAIL", None, one_line(err) if not hasattr(err, "failure") else str(err)
    value = ret._return_value
    if isinstance(value, dict):
        if value.get("status") == "pruned":
            return "PRUNED", None, ""
        return "FAIL", None, f"the job returned no objective (status {value.get('status')})"
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        return "FAIL", None, f"the job returned {value!r}, not a number"
    if len(values) != n_objectives:
        return "FAIL", None, f"the job returned {len(values)} value(s) for {n_objectives} objective(s)"
    return "COMPLETE", values, ""


def _under(path: str | None, sweep_dir: Path) -> bool:
    if not path:
        return False
    try:
        Path(path).resolve().relative_to(sweep_dir.resolve())
        return True
    except ValueError:
        return False


def sweep(params, config, launcher, arguments: list[str]) -> None:
    """hydra/sweeper=expgpu_optuna's sweep(): check everything, open the study, run it."""
    import optuna
    from omegaconf import OmegaConf

    from expgpu.tune import space as spaces
    from expgpu.tune.runners import runner_for
    from expgpu.tune.settings import check

    s = check(params, OmegaConf.select(config, "objective", default=None))
    space = spaces.parse(s.params, list(arguments))
    if not space.distributions and not s.custom_search_space:
        raise UserError("hydra/sweeper=expgpu_optuna: nothing to search; give parameters as hydra.sweeper.params "
                        "or sweeps on the command line, e.g. 'task.optimizer.lr=tag(log, interval(1e-4,1e-1))'")
    optuna.logging.set_verbosity(optuna.logging.WARNING)   # the sweep's own lines say what a trial did
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    study, where = studies.open_study(s, sweep_dir)
    runner = runner_for(launcher, s.n_jobs)
    log.info("study %s in %s: %d trials, %d at once (%s), objective %s (%s), sampler %s, pruner %s",
             study.study_name, where, s.n_trials, runner.capacity, type(runner).__name__, ",".join(s.objective),
             ",".join(s.directions), type(study.sampler).__name__, type(study.pruner).__name__)
    Sweep(s, space, study, where, runner, sweep_dir, config).run()
