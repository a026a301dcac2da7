"""Where a run is and how long it has left: its pace, put in every metrics.jsonl row and shown on the console.

`Pace` measures steps per second over the last WINDOW_S of rows (the first rows, before a window has
passed, from the run's start: a first step that compiles makes the first figure pessimistic) and, with
the run's length, the time left. Its fields go into each row, for tools to read:

    max_steps     the run's steps in all (run.steps' max_steps; under run.epochs, the epochs' batches when the
                  loader has a length; a script's expgpu.log(max_steps=...)), when known
    epochs        under run.epochs: how many epochs the loop runs
    steps_per_s   steps per second, lately
    eta_s         seconds left to max_steps at that pace
    data_wait     the share of that time rank 0 waited for its batches in run.steps (taking the next one from
                  its loader, moving it to the device): near 0 when the loader keeps ahead of the steps

`Display` shows them: a log line at most every PROGRESS_EVERY_S and the last one at the end; on an interactive
terminal one live line there instead (rich's progress bar, which stays when the run ends), while the log files
keep the lines:

    step 60/200 (30 %)  epoch 2/5  loss 0.0404  12.3 steps/s  data 35%  ETA 0:00:11

(`data 35%` only from DATA_SHOWN up: a loader that keeps up is no news.)
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from typing import Any

log = logging.getLogger("expgpu")

FIELDS = ("max_steps", "epochs", "steps_per_s", "eta_s", "data_wait")
PACE = ("steps_per_s", "eta_s", "data_wait")   # the fields the clock decides: two runs of the same steps differ in them
DATA_SHOWN = 0.05   # the progress line says `data N%` from this share of the time waited for batches up
DATA_WARN = 0.25    # from this share up, the run's end (expgpu.train.run_end) and `expgpu status` say so
WINDOW_S = 30.0   # the pace is over the rows of about this many seconds: it follows a change within a minute

# Without a terminal, a progress line at most this often (and the last row at the end): a line per
# log_every steps filled logs with hundreds of lines, and on a busy machine each line (formatted,
# written to the console, the job's log and the rank's log, read by whoever holds the console)
# costs rank 0, and so every rank waiting for it at the next all-reduce.
PROGRESS_EVERY_S = 5.0
# On a terminal, the live bar is redrawn at most this often (rich repaints it 10 times a second anyway); a
# row in between is put into words only if it is the last (close)
BAR_EVERY_S = 0.1


class Pace:
    """Steps per second over the last WINDOW_S, the time left to max_steps, and the share of the window spent
    waiting for data."""

    def __init__(self, start_step: int, max_steps: int | None = None, epochs: int | None = None):
        self.max_steps, self.epochs = max_steps, epochs
        # (time.monotonic, step, seconds waited for data so far or None)
        self.points: collections.deque[tuple[float, int, float | None]] = collections.deque(
            [(time.monotonic(), start_step, 0.0)])

    def fields(self, step: int, now: float | None = None, waited: float | None = None) -> dict[str, Any]:
        """This row's progress fields (those known), for a row made at `now` (time.monotonic's; now if None),
        when the loop had waited `waited` seconds for its batches in all (None: it takes none from a loader)."""
        now = time.monotonic() if now is None else now
        points = self.points
        if step < points[-1][1]:   # a step logged behind the last (an evaluation's own): no pace from it
            return self._known(step, None, None)
        points.append((now, step, waited))
        while len(points) > 2 and now - points[1][0] >= WINDOW_S:
            points.popleft()   # the oldest point kept is the newest one at least WINDOW_S old
        (t0, s0, w0), rate, share = points[0], None, None
        if now > t0 and step > s0:
            rate = (step - s0) / (now - t0)
            if waited is not None and w0 is not None:
                share = min(1.0, max(0.0, (waited - w0) / (now - t0)))
        return self._known(step, rate, share)

    def _known(self, step: int, rate: float | None, share: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.max_steps is not None:
            out["max_steps"] = self.max_steps
        if self.epochs is not None:
            out["epochs"] = self.epochs
        if rate is not None:
            out["steps_per_s"] = float(f"{rate:.4g}")
            if self.max_steps is not None:
                out["eta_s"] = round(max(0, self.max_steps - step) / rate, 1)
        if share is not None:
            out["data_wait"] = round(share, 3)
        return out


class Display:
    """A log line every PROGRESS_EVERY_S (and the last at the end); when stderr is a terminal, a live bar there
    instead, the lines then kept off the terminal's log handlers (the log files still get them)."""

    def __init__(self, total: int | None, start: int, live: bool | None = None):
        self.bar = None
        self.shown_at: float | None = None   # when the last line was written
        self.unshown: tuple | None = None    # the last row not shown yet: line()'s arguments, formatted if shown
        self.drawn_at: float | None = None   # when the bar was last drawn
        self.undrawn: tuple | None = None    # the last row not drawn on the bar yet
        self.muted: list[logging.Handler] = []
        if sys.stderr.isatty() if live is None else live:
            from rich.progress import Progress

            self.bar = Progress(transient=False)
            self.bar.start()
            self.task = self.bar.add_task("training", total=total, completed=start)
            self.muted = [h for h in _handlers() if _on_terminal(h)]
            for handler in self.muted:
                handler.addFilter(_not_progress)

    def update(self, step: int, values: dict[str, Any], fields: dict[str, Any], epoch: int | None = None,
               first_epoch: int = 0) -> None:
        """A row: its step, its logged values, its progress fields; `epoch` under run.epochs. Called at every
        flush of the training loop (every task.log_every steps): a row is put into words only when shown."""
        args = (step, values, fields, epoch, first_epoch)
        now = time.monotonic()
        if self.bar is not None:
            self.undrawn = args
            if self.drawn_at is None or now - self.drawn_at >= BAR_EVERY_S:
                self._draw()
                self.drawn_at = now
        if self.shown_at is not None and now - self.shown_at < PROGRESS_EVERY_S:
            self.unshown = args
            return
        self.shown_at, self.unshown = now, None
        log.info("%s", line(*args), extra={PROGRESS: True})

    def _draw(self) -> None:
        args = self.undrawn
        step, fields = args[0], args[2]
        self.bar.update(self.task, completed=step, total=fields.get("max_steps"), description=line(*args, bar=True))
        self.undrawn = None

    def close(self) -> None:
        if self.bar is not None and self.undrawn is not None:
            self._draw()
        if self.unshown is not None:
            log.info("%s", line(*self.unshown), extra={PROGRESS: True})
            self.unshown = None
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        for handler in self.muted:
            handler.removeFilter(_not_progress)
        self.muted = []


PROGRESS = "expgpu_progress"   # a log record's attribute: a progress line (off the terminal under a live bar)


def _not_progress(record: logging.LogRecord) -> bool:
    return not getattr(record, PROGRESS, False)


def _handlers() -> list[logging.Handler]:
    """The handlers a record of expgpu's logger reaches: its own and its ancestors' (Hydra's console, its file)."""
    out, logger = [], log
    while logger is not None:
        out += logger.handlers
        logger = logger.parent if logger.propagate else None
    return out


def _on_terminal(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    try:
        return not isinstance(handler, logging.FileHandler) and stream is not None and stream.isatty()
    except (AttributeError, ValueError):   # a closed stream, or one with no isatty
        return False


def line(step: int, values: dict[str, Any], fields: dict[str, Any], epoch: int | None = None,
         first_epoch: int = 0, bar: bool = False) -> str:
    """`step 60/200 (30 %)  epoch 2/5  loss 0.0404  12.3 steps/s  ETA 0:00:11` (without what is not known;
    `bar`: the step, share and ETA left to rich's own columns)."""
    total = fields.get("max_steps")
    parts = []
    if not bar:
        parts.append(f"step {step}/{total} ({100 * step / total:.0f} %)" if total else f"step {step}")
    if epoch is not None and fields.get("epochs"):
        parts.append(f"epoch {min(epoch - first_epoch + 1, fields['epochs'])}/{fields['epochs']}")
    parts += [f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()]
    if fields.get("steps_per_s") is not None:
        rate = fields["steps_per_s"]
        # three digits, and never 1.29e+03: a fast loop's pace reads as 1290
        parts.append(f"{rate:.0f} steps/s" if rate >= 100 else f"{rate:.3g} steps/s")
    if fields.get("data_wait", 0) >= DATA_SHOWN:
        parts.append(f"data {100 * fields['data_wait']:.0f}%")
    if not bar and fields.get("eta_s") is not None:
        parts.append(f"ETA {_clock(fields['eta_s'])}")
    return "  ".join(parts) if parts else "training"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


__all__ = ["DATA_SHOWN", "DATA_WARN", "FIELDS", "PACE", "PROGRESS_EVERY_S", "WINDOW_S", "Display", "Pace", "line"]
