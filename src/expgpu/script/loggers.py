"""Rank 0's supervisor hands the chosen loggers (csv, tensorboard, mlflow, wandb) the rows the script's
expgpu.log appends to metrics.jsonl, at most once a second, and their outcome when the script ends; and shows
the script's progress from them (expgpu.loggers.progress: its step, of max_steps when the script says it, its
pace and time left), here, where expgpu's console is, not in the script's own output. When an optimizing
sweeper started the job as a trial, its pruner gets the rows too (expgpu.tune.bridge, expgpu.script.prune).

The loggers live here, in one process from start to finish, as they live in a function task's rank 0;
the script's own process only appends rows (one writer: expgpu.loggers.jsonl.MetricsLog). Where this
attempt's rows begin, and whether it resumed, the script's first expgpu.log call says in
RUN_DIR/.expgpu/script-log.json (removed before the script starts): the loggers start then, with the
resume rules of expgpu.loggers (rows they lack from earlier attempts are sent from metrics.jsonl).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from expgpu import loggers, rundir
from expgpu.loggers import base
from expgpu.loggers.jsonl import WRITE_EVERY_S
from expgpu.loggers.progress import FIELDS, Display

TRIAL_POLL_S = 0.1   # each of the script process's ticks (process.TICK_S): a pruned trial frees its slot sooner


class LoggerFeed:
    def __init__(self, cfg: dict, run_dir: Path, trial: base.Sink | None = None):
        """`trial`: the study's reporter (expgpu.tune.bridge) when the job is a trial whose sweeper prunes."""
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.jsonl = self.run_dir / rundir.METRICS
        self.chosen = loggers.chosen(cfg)
        self.loggers: loggers.Loggers | None = None
        self.display: Display | None = None
        self.begun = False
        self.offset = 0           # metrics.jsonl's bytes handed on so far
        self.polled = 0.0
        self.last_row: dict | None = None
        self.trial = trial

    def poll(self, force: bool = False) -> None:
        # a trial's rows are looked at more often: the script writes its objective's at once (expgpu.script.log)
        every = TRIAL_POLL_S if self.trial is not None and not self.trial.done else WRITE_EVERY_S
        if not force and time.monotonic() - self.polled < every:
            return
        self.polled = time.monotonic()
        if not self.begun and not self._start():
            return
        rows = self._new_rows()
        if rows:
            if self.loggers is not None:
                self.loggers.write(rows)
            if self.trial is not None:
                self.trial.write(rows)   # a prune requests a PRUNED stop (expgpu.procs.stop_signals)
            self.last_row = last = rows[-1]
            self.display.update(last["step"], {k: v for k, v in base.values(last).items() if k != "epoch"},
                                {k: last[k] for k in FIELDS if k in last})

    def _start(self) -> bool:
        try:
            begun = json.loads(rundir.script_log_marker(self.run_dir).read_text())
        except (OSError, ValueError):
            return False   # the script has logged nothing yet
        if self.chosen:
            self.loggers = loggers.build(self.cfg, self.run_dir)
            self.loggers.start(begun["resumed"], begun["step"], begun["flushed_before"], self.jsonl)
        self.display = Display(None, begun["step"])
        self.offset, self.begun = begun["offset"], True
        return True

    def _new_rows(self) -> list[dict]:
        """Whole lines appended since the last poll (a line still being written waits for the next)."""
        try:
            with open(self.jsonl, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        rows = []
        for line in whole.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

    def finish(self, status: str, metrics: dict, steps: int | None) -> None:
        """The loggers' outcome: finished, stopped or failed, and the last value of every logged name."""
        self.poll(force=True)
        if self.display is not None:
            self.display.close()
            self.display = None
        if not self.chosen:
            return
        if self.loggers is None:
            if status != "finished":
                return   # as a function task: no logger run for a run that logged nothing and did not finish
            self.loggers = loggers.build(self.cfg, self.run_dir)
        # every value in `metrics` is a logged row's already: no second point for any of them
        self.loggers.finish(status, metrics, steps or 0, {**(self.last_row or {}), **metrics})
