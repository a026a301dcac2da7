"""The sweeper's loop: ask the study for a trial the moment a slot is free, start its job, wait for
any job to end, tell the study how it ended; until n_trials trials (all of the study's, whatever
their state, so a rerun of the sweep dir counts what it finds) have ended.

A rerun of the same sweep dir (hydra.sweep.dir=...) continues the study: finished, pruned and failed
trials are kept, and a trial still RUNNING in it (its sweeper died: Ctrl-C, a node lost, the sweeping
job's time limit) is started again in its own job dir, where expgpu resumes it from its checkpoint.
The sweep's first line says which it is ("continuing study X: N trials done, M to go").

Failures: when more than max_failure_rate of the last n_jobs trials that ended failed (Hydra's optuna
sweeper judges each batch of n_jobs), the search stops: running trials save and stay RUNNING for a
rerun, and the sweep ends in SweepFailed, whose line ends with the first failure's reason.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import shlex
import sys
import time
import traceback
from pathlib import Path

from expgpu.errors import Stopped, UserError, one_line
from expgpu.results import nonfinite_words
from expgpu.tune import TRIAL_ENV
from expgpu.tune import study as studies
from expgpu.tune.runners import Runner
from expgpu.tune.settings import Settings
from expgpu.tune.space import Space

# the reason a trial that task.on_nonfinite=stop ended is told to the study with, as PRUNED
DIVERGED = "diverged: "

log = logging.getLogger("expgpu")

WAIT_S = 1.0   # a wait for any job to end returns at least this often (stop requests are checked)
# study.json (every trial's row, for the report and `expgpu status`) is rewritten whole with fsyncs: while
# trials run, at most this often (with trials ending every few tenths of a second it was ~6 ms of the
# loop's each, and O(trials) a write), and always at the sweep's end.
SUMMARY_EVERY_S = 1.0


class SweepFailed(Exception):
    """Too many trials failed, or none completed: the search ends without a best (exit code 1)."""


class Sweep:
    def __init__(self, s: Settings, space: Space, study, where: str, runner: Runner, sweep_dir: Path, cfg,
                 custom=None):
        self.s, self.space, self.study, self.where, self.runner = s, space, study, where, runner
        self.sweep_dir, self.cfg, self.custom = Path(sweep_dir), cfg, custom
        self.active: dict[int, object] = {}   # job number -> the trial it runs
        self.warned_unlogged = False
        self._stop_sent = False
        # whether each of the last n_jobs trials that ended failed (max_failure_rate's window)
        self.window = max(1, min(runner.capacity, s.n_trials))
        self.recent: collections.deque[bool] = collections.deque(maxlen=self.window)
        self.first_failure: tuple[int, str, object] | None = None
        self.failures = 0
        self._summary_due = False
        self._summary_at = 0.0   # time.monotonic() of the last study.json

    def run(self) -> None:
        from optuna.trial import TrialState

        resumed = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if _under(t.user_attrs.get(studies.JOB_DIR), self.sweep_dir)]
        self._first_line(len(self.study.get_trials(deepcopy=False)) - len(resumed), len(resumed))
        try:
            from optuna.trial import Trial

            for frozen in resumed:   # Optuna's handle on a trial asked by an earlier sweeper process
                self._start(Trial(self.study, frozen._trial_id), frozen.user_attrs[studies.OVERRIDES])
            self._loop()
            if not self.runner.stopping():
                self._judge(final=True)
        finally:
            self.runner.close()
            self._summarize(now=True)
        if self.runner.stopping():
            log.warning("sweep stopped: %d trial(s) saved as they were; rerun the same command with "
                        "hydra.sweep.dir=%s to continue the study", len(self.active), self.sweep_dir)
            raise KeyboardInterrupt
        self._finish()

    def _first_line(self, done: int, resumed: int) -> None:
        s, study = self.s, self.study
        how = (f"{self.runner.capacity} at once ({type(self.runner).__name__}), "
               f"{'objective ' + ','.join(s.objective) if s.objective else 'the returned value'} "
               f"({','.join(s.directions)}), sampler {type(study.sampler).__name__}, "
               f"pruner {type(study.pruner).__name__}")
        if done or resumed:
            head = (f"continuing study {study.study_name} in {self.where}: {done} trial(s) done, "
                    f"{max(0, s.n_trials - done)} to go ({resumed} of them resumed from their job dirs)")
        else:
            head = f"study {study.study_name} in {self.where}: {s.n_trials} trials"
        searched = ", ".join(self.space.distributions) or "nothing (every trial runs the same overrides)"
        taken = (f"; not searched, as set on the command line: {' '.join(self.space.taken_out)}"
                 if self.space.taken_out else "")
        log.info("%s, %s; searching %s%s", head, how, searched, taken)

    def _loop(self) -> None:
        while True:
            if not self.runner.stopping():
                self._fill()
            if not self.active:
                return
            for num, ret in self.runner.wait(WAIT_S):
                self._ended(num, ret)
            self._summarize()
            if self.runner.stopping():
                if not self.runner.busy():   # what was queued never started: it stays RUNNING for a rerun
                    return
                if not self._stop_sent:
                    self._stop_sent = True
                    self.runner.stop()

    def _summarize(self, now: bool = False) -> None:
        """study.json, if a trial ended since it was written and SUMMARY_EVERY_S have passed (now: at once)."""
        if now or (self._summary_due and time.monotonic() - self._summary_at >= SUMMARY_EVERY_S):
            studies.write_summary(self.study, self.s, self.sweep_dir)
            self._summary_due, self._summary_at = False, time.monotonic()

    def _fill(self) -> None:
        """Trials started until every slot is busy (and `ahead` more wait, ready), or n_trials are."""
        total = len(self.study.get_trials(deepcopy=False))
        if hasattr(self.runner, "expect"):
            self.runner.expect(self.s.n_trials - total)
        room = self.runner.capacity + self.runner.ahead - len(self.active)
        for _ in range(max(0, min(room, self.s.n_trials - total))):
            trial = self.study.ask(self.space.distributions)
            if self.custom is not None:
                self.custom(self.cfg, trial)
            self._start(trial, self.space.overrides(trial.params))

    def _start(self, trial, overrides: list[str]) -> None:
        path = studies.attach(self.study, trial, self.sweep_dir, self.where, self.s, overrides)
        job_dir = self.runner.submit(overrides + [f"++hydra.job.env_set.{TRIAL_ENV}={shlex.quote(str(path))}"],
                                     trial.number)
        trial.set_user_attr(studies.JOB_DIR, str(Path(job_dir).absolute()))
        self.active[trial.number] = trial

    def _ended(self, num: int, ret) -> None:
        trial = self.active.pop(num)
        state, values, reason = outcome(ret, len(self.s.directions), self.s.objective)
        if state == "STOPPED" or (state == "FAIL" and self.runner.stopping()):
            return   # the sweeper is stopping: the trial stays RUNNING, and a rerun resumes it
        if state == "USER_ERROR":
            studies.tell(self.study, trial, "FAIL", reason=reason)
            self._halt()
            raise UserError(f"trial {num}: {reason}")
        studies.tell(self.study, trial, state, values, reason)
        shown = {"COMPLETE": lambda: f"{', '.join(f'{v:.6g}' for v in values)}",
                 "PRUNED": lambda: f"pruned ({reason})" if reason else "pruned",
                 "FAIL": lambda: f"failed: {reason}"}[state]()
        log.info("trial %d: %s (%s)", num, shown, " ".join(f"{k}={v}" for k, v in trial.params.items()))
        if state == "COMPLETE" and self.s.pruner and not self.warned_unlogged:
            self._check_logged(num)
        self._summary_due = True
        self.recent.append(state == "FAIL")
        if state == "FAIL":
            self.failures += 1
            self.first_failure = self.first_failure or (num, reason, ret._return_value)
        self._judge()

    def _judge(self, final: bool = False) -> None:
        """Stop the search once more than max_failure_rate of the last n_jobs trials failed (at the
        end, the last trials ended count over their own number, as Hydra's last, smaller batch)."""
        failed = sum(self.recent)
        over = failed / (len(self.recent) if final else self.window) if self.recent else 0.0
        if failed == 0 or over <= self.s.max_failure_rate:
            return
        if not final:
            self._halt()
        num, reason, err = self.first_failure
        if isinstance(err, BaseException) and err.__traceback__ is not None:   # a job that ran in this process
            traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        raise SweepFailed(f"the search stopped: {failed} of the last {len(self.recent)} trial(s) failed, more than "
                          f"hydra.sweeper.max_failure_rate={self.s.max_failure_rate:g} allows; first failure: "
                          f"trial {num}: {reason}")

    def _halt(self) -> None:
        """Ask the running trials to stop, and wait for them to save (they stay RUNNING for a rerun)."""
        self.runner.stop()
        self._drain()

    def _check_logged(self, num: int) -> None:
        """A pruner that was never told anything prunes nothing: say so after the first trial."""
        self.warned_unlogged = True
        frozen = self.study.get_trials(deepcopy=False)[num] if num < len(self.study.trials) else None
        if frozen is not None and frozen.number == num and not frozen.intermediate_values:
            log.warning("hydra.sweeper.pruner: trial %d never logged %s with run.log (expgpu.log in a script task), "
                        "so the pruner has nothing to go on and prunes no trial; log it where you evaluate "
                        "(run.log(%s=...))", num, self.s.metric, self.s.metric)

    def _drain(self) -> None:
        """Wait for the stopped trials' jobs to end (they save); they stay RUNNING for a rerun."""
        deadline = time.monotonic() + 120
        while self.active and self.runner.busy() and time.monotonic() < deadline:
            for num, _ in self.runner.wait(WAIT_S):
                self.active.pop(num, None)

    def _finish(self) -> None:
        doc = studies.write_results(self.study, self.sweep_dir)
        if doc is None:   # nothing learnt: no best to write, and a script reading the exit code must know
            raise SweepFailed(self._nothing_completed())
        if "best_value" in doc:
            log.info("best: %s=%g with %s", self.s.metric or "value", doc["best_value"],
                     " ".join(f"{k}={v}" for k, v in doc["best_params"].items()))
        else:
            log.info("Pareto front: %d trial(s)", len(doc["solutions"]))

    def _nothing_completed(self) -> str:
        """Why the search ends without a best: its trials' states, and what to change."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        failed = sum(t.state == TrialState.FAIL for t in trials)
        diverged = sum(t.state == TrialState.PRUNED and str(t.user_attrs.get(studies.REASON)).startswith(DIVERGED)
                       for t in trials)
        pruned = sum(t.state == TrialState.PRUNED for t in trials) - diverged
        counts = ", ".join(f"{n} {what}" for n, what in ((failed, "failed"), (diverged, "diverged"),
                                                         (pruned, "pruned")) if n)
        if failed:
            why = (f"which max_failure_rate={self.s.max_failure_rate:g} let the search go past (each trial's "
                   "reason: the lines above")
        elif not pruned:
            why = ("every trial's loss became nan or inf, and task.on_nonfinite=stop ended it there: narrow the "
                   "search to steadier settings, a smaller learning rate above all (each trial's step")
        else:
            why = (f"the pruner ({type(self.study.pruner).__name__}) stopped every trial before its last step: "
                   "loosen it (n_warmup_steps, min_resource) or check hydra.sweeper.direction against the "
                   "objective (each trial's last report")
        return f"no trial completed: {counts}, {why}, and {self.sweep_dir / 'study.json'}); no best to write"


def outcome(ret, n_objectives: int, names: tuple[str, ...] | None = None) -> tuple[str, list[float] | None, str]:
    """(COMPLETE | PRUNED | FAIL | STOPPED | USER_ERROR, values, reason) of a job's JobReturn. The
    objective is the returned value (a number, or one per direction), or the `names` metrics of a
    returned dict."""
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
        if value.get("status") == "diverged":   # task.on_nonfinite=stop: a bad region, as a prune tells the sampler
            return "PRUNED", None, f"{DIVERGED}{nonfinite_words(value.get('nonfinite'))}"
        if "status" in value and value["status"] != "finished":   # an expgpu result: it ended otherwise
            return "FAIL", None, f"the job returned no objective (status {value.get('status')})"
        if not names:
            return "USER_ERROR", None, (f"the task returned a dict ({', '.join(map(str, value)) or 'empty'}), not a "
                                        "number: name the metric(s) to optimize with objective=<key> (+objective=<key> "
                                        "where the config has no such key), or return the value itself")
        missing = [n for n in names if not isinstance(value.get(n), (int, float))]
        if missing:
            return "USER_ERROR", None, (f"objective={missing[0]}: the task returned no metric {missing[0]!r}; it "
                                        f"returned {', '.join(map(str, value)) or 'nothing'}")
        value = [value[n] for n in names]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        return "FAIL", None, f"the task returned {value!r}, not a number (or one per direction)"
    if len(values) != n_objectives:
        return "USER_ERROR", None, (f"the task returned {len(values)} value(s), but hydra.sweeper.direction has "
                                    f"{n_objectives}: give one direction per value (a list for several)")
    if any(math.isnan(v) for v in values):   # Optuna refuses it as a trial's value; Hydra's sweeper fails the trial
        return "FAIL", None, (f"the objective is nan{f' ({names[0]})' if names and len(names) == 1 else ''}: the "
                              "run diverged, or its metric is undefined")
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
    from expgpu.tune.settings import check_optuna

    check_optuna()
    import optuna
    from omegaconf import OmegaConf

    from expgpu.config import is_expgpu
    from expgpu.tune import space as spaces
    from expgpu.tune.runners import runner_for
    from expgpu.tune.settings import build, check

    s = check(params, OmegaConf.select(config, "objective", default=None))
    if s.objective is None and is_expgpu(config):
        raise UserError("objective=None: hydra/sweeper=expgpu_optuna needs the metric to optimize, e.g. "
                        "objective=accuracy (a metric the task returns), or a list of them")
    space = spaces.parse(s.params, list(arguments))
    custom = _custom(s.custom_search_space)
    sampler = build(s.sampler, "sampler")
    if isinstance(sampler, functools.partial):   # GridSampler: its grid is the search space
        grid = spaces.grid_of(space)
        sampler = sampler(search_space=grid)
        size = math.prod(len(v) for v in grid.values())
        if size < s.n_trials:
            log.info("n_trials %d -> %d: GridSampler's grid has %d point(s)", s.n_trials, size, size)
            s = dataclasses.replace(s, n_trials=size)
    optuna.logging.set_verbosity(optuna.logging.WARNING)   # the sweep's own lines say what a trial did
    runner = runner_for(launcher, s.n_jobs)
    if is_expgpu(config) and config.dry_run:
        return _dry_run(s, space, custom, sampler, config, launcher, runner.capacity)
    # a trial drawn aside (in memory, at random: the study's sampler untouched) for the runner's check
    runner.check(lambda: _drawn(optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)), space, custom,
                                config))
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    study, where = studies.open_study(s, sweep_dir, sampler)
    Sweep(s, space, study, where, runner, sweep_dir, config, custom).run()


def _dry_run(s: Settings, space: Space, custom, sampler, config, launcher, at_once: int) -> None:
    """dry_run=true: the trials that would start first (as many as run at once), each job printing its plan
    through the launcher. Nothing trains, so no trial has an objective: the search stops there, and no study is
    stored (a rerun into this sweep dir must not continue one of trials that never ran)."""
    import optuna

    study = optuna.create_study(sampler=sampler, directions=list(s.directions))   # in memory only
    batch = [_drawn(study, space, custom, config) for _ in range(min(s.n_trials, at_once))]
    launcher.launch(batch, initial_job_idx=0)
    log.info("dry run: the first %d of %d trial(s) planned, nothing trained; the search needs their results to go "
             "on, so it stops here (no study stored)", len(batch), s.n_trials)


def _drawn(study, space: Space, custom, config) -> list[str]:
    """The overrides of a trial `study` draws (and custom_search_space's suggestions)."""
    trial = study.ask(space.distributions)
    if custom is not None:
        custom(config, trial)
    return space.overrides(trial.params)


def _custom(path: str | None):
    """custom_search_space's function, found before any trial (one line when it is not there)."""
    if path is None:
        return None
    from hydra.utils import get_method

    try:
        return get_method(path)
    except Exception as e:
        raise UserError(f"hydra.sweeper.custom_search_space={path}: cannot be found ({one_line(e.__cause__ or e)}); "
                        "allowed: the dotted path of a function (cfg, trial) -> None, importable from the "
                        "directory you launch from") from None

