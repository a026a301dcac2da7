"""In a trial's job, on rank 0: each row run.log writes to metrics.jsonl that holds the objective is
reported to the trial at its step, and when the study's pruner says so, a PRUNED stop is requested.
The ranks agree on it at their next stop poll (expgpu.train.agreement), so all of them stop at the same step,
and the job ends with result.json's status `pruned` (final: nothing is saved to resume it): its slot is free for
the next trial. Every value is reported as an Optuna objective would report it, nan and inf included: Optuna's
median, percentile, successive-halving and threshold pruners prune a trial whose value is nan.

The worker hands a TrialReporter to rank 0's MetricsLog as one of its sinks (expgpu.loggers.base.Sink)
when the job was started as a trial (TRIAL_ENV names its file), or to a script task's rank 0 supervisor,
which feeds it the rows the script logs (expgpu.script.prune); a run that is no trial never imports Optuna.
A study that cannot be reached is a warning, once: the trial trains on, unpruned.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

from expgpu.errors import one_line
from expgpu.loggers.base import Sink
from expgpu.procs import stop_signals
from expgpu.tune import TRIAL_ENV

log = logging.getLogger("expgpu")


class TrialReporter(Sink):
    def __init__(self, spec: dict):
        self.spec = spec
        self.key = spec["objective"]
        self.prompt = frozenset({self.key})   # its rows at once: the pruner's verdict waits for them
        self.trial = None
        self.done = False   # pruned, or the study unreachable: nothing more to report

    @classmethod
    def attach(cls, path: str) -> "TrialReporter | None":
        try:
            spec = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            log.warning("expgpu: %s=%s: the trial's file cannot be read (%s); not reporting to the study",
                        TRIAL_ENV, path, one_line(e))
            return None
        return cls(spec) if spec.get("objective") and spec.get("pruner") else None

    def write(self, rows: list[dict]) -> None:
        values = [(row["step"], row[self.key]) for row in rows if self.key in row]
        if self.done or not values:
            return
        try:
            trial = self.trial or self._open()
            with warnings.catch_warnings():   # a step reported before a resume: Optuna keeps the first
                warnings.simplefilter("ignore")
                for step, value in values:
                    # nan and inf too, as an Optuna objective reports them: its pruners prune a trial whose
                    # value is nan (a diverged run), which a value left out would let train to its end
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        trial.report(float(value), int(step))
            prune = not _at_end(rows[-1]) and trial.should_prune()
        except Exception as e:
            self.done = True
            log.warning("expgpu: trial %s: reporting %s to the study failed (%s); it trains on, unpruned",
                        self.spec.get("number"), self.key, one_line(e))
            return
        if prune:
            self.done = True
            step, value = values[-1]
            log.info("trial %s: pruned at step %d (%s %g): stopping", self.spec["number"], step, self.key, value)
            stopper = stop_signals.current()   # the run's (its steps poll it), or the script's supervisor's
            if stopper is not None:
                stopper.request(stop_signals.PRUNED)

    def _open(self):
        import optuna

        from expgpu.tune.settings import build
        from expgpu.tune.storage import open_storage

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=self.spec["study"], storage=open_storage(self.spec["storage"]),
                                  sampler=optuna.samplers.RandomSampler(), pruner=build(self.spec["pruner"], "pruner"))
        self.trial = optuna.trial.Trial(study, self.spec["trial_id"])
        return self.trial


def _at_end(row: dict) -> bool:
    """The run's last step: its training is paid for, and pruning it now would only throw its result away
    (a median or successive-halving pruner judges the last report as any other: a trial below the bar
    there would end PRUNED, its objective lost to the study, having saved nothing)."""
    max_steps = row.get("max_steps")
    return isinstance(max_steps, int) and row["step"] >= max_steps


def attached() -> TrialReporter | None:
    """This process's trial, when an optimizing sweeper started its job as one (the worker asks, for rank 0's
    rows: a function task's, or those its script logs)."""
    path = os.environ.get(TRIAL_ENV)
    return TrialReporter.attach(path) if path else None
