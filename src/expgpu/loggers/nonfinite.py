"""A loss or a score that stops being a finite number (nan, inf): said once, when its row is written.

A learning rate too high, or an fp16 overflow without a loss scaler, turns the loss into nan; from then on
the parameters are usually nan too, and the run trains to its end on nothing (a sweep's diverged trials pay
their whole budget). By default the loop goes on as a plain PyTorch loop would (a value is read only where
the row is written, on rank 0: nothing is added to a step), but the first such value of each name is said at
once, and result.json's `nonfinite` keeps the step. Under task.on_nonfinite=stop (Keras's TerminateOnNaN,
Lightning's EarlyStopping check_finite) the run is handed a `stop` to call there: the ranks agree on it at
their next stop poll (expgpu.train.agreement) and the run ends as `diverged`, its slot free within about a
second of the row. Names of no known kind (grad_norm, lr: an fp16 loss scaler's inf gradient norm is
routine) are left alone; the kinds are the sweep report's (expgpu.report.best.kind).
"""

from __future__ import annotations

import logging
import math
from typing import Callable

log = logging.getLogger("expgpu")

CAUSES = "a learning rate too high, or an fp16 overflow without a loss scaler, is the usual cause"


class NonFinite:
    def __init__(self, stop: Callable[[], None] | None = None, script: bool = False) -> None:
        """`stop`: task.on_nonfinite=stop's request that every rank stop (None: the run goes on); `script`: a
        script task's rows, written in its own process (its loop is its own: expgpu cannot stop it)."""
        self.first: dict[str, int] = {}     # name -> the step of its first value that was not finite
        self._judged: dict[str, bool] = {}  # name -> whether it is a loss or a score
        self._stop = stop
        self._script = script

    def check(self, rows: list[dict], keys: frozenset[str] | tuple = ()) -> None:
        """Rows as written (numbers read); `keys`: the row's own fields (step, time, ...), never judged."""
        for row in rows:
            for name, value in row.items():
                if isinstance(value, float) and not math.isfinite(value) and name not in self.first \
                        and name not in keys and self._watched(name):
                    self.first[name] = row["step"]
                    self._said(name, value, row["step"])

    def _said(self, name: str, value: float, step: int) -> None:
        what = f"{name} is {value} at step {step}, the first logged value of it that is not a finite number"
        if self._script:
            log.warning("%s; the script goes on (%s)", what, CAUSES)
            return
        if self._stop is None:
            log.warning("%s; the run goes on to its end (task.on_nonfinite=stop ends it there; %s)", what, CAUSES)
            return
        if len(self.first) == 1:   # the first name to diverge stops the run; the others are only kept
            log.warning("%s; stopping every rank (task.on_nonfinite=stop): the run ends as diverged (%s)",
                        what, CAUSES)
            self._stop()

    def _watched(self, name: str) -> bool:
        if name not in self._judged:
            from expgpu.report.best import kind  # only once a value is not finite: the report loads nothing else

            self._judged[name] = kind(name) in ("loss", "score")
        return self._judged[name]
