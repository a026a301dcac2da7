"""A loss or a score that stops being a finite number (nan, inf): said once, when its row is written.

A learning rate too high, or an fp16 overflow without a loss scaler, turns the loss into nan; from then on
the parameters are usually nan too, and the run trains to its end on nothing (a sweep's diverged trials pay
their whole budget). The loop goes on as a plain PyTorch loop would (a value is read only where the row is
written, on rank 0: nothing is added to a step), but the first such value of each name is said at once, and
result.json's `nonfinite` keeps the step. Names of no known kind (grad_norm, lr: an fp16 loss scaler's inf
gradient norm is routine) are left alone; the kinds are the sweep report's (expgpu.report.best.kind).
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger("expgpu")


class NonFinite:
    def __init__(self) -> None:
        self.first: dict[str, int] = {}     # name -> the step of its first value that was not finite
        self._judged: dict[str, bool] = {}  # name -> whether it is a loss or a score

    def check(self, rows: list[dict], keys: frozenset[str] | tuple = ()) -> None:
        """Rows as written (numbers read); `keys`: the row's own fields (step, time, ...), never judged."""
        for row in rows:
            for name, value in row.items():
                if isinstance(value, float) and not math.isfinite(value) and name not in self.first \
                        and name not in keys and self._watched(name):
                    self.first[name] = row["step"]
                    log.warning("%s is %s at step %d, the first logged value of it that is not a finite number; "
                                "the run goes on to its end (a learning rate too high, or an fp16 overflow without "
                                "a loss scaler, is the usual cause)", name, value, row["step"])

    def _watched(self, name: str) -> bool:
        if name not in self._judged:
            from expgpu.report.best import kind  # only once a value is not finite: the report loads nothing else

            self._judged[name] = kind(name) in ("loss", "score")
        return self._judged[name]
