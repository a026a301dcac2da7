"""What `run.log` records: rank 0's scalars, read back only when they are written.

A logged tensor stays on its device until a flush (every `task.log_every` steps, at a stop, at
the end): reading it back (`.item()`) waits for the GPU, which a plain PyTorch loop also does
only when it prints. Between two flushes each name keeps one value and the step it was last
logged at, so a metric logged every step costs one read per flush, and one logged at an odd step
(an evaluation) is still written, at its own step. Which value (`task.log_reduce`): the last one
logged (MetricsLog, the default: a row is a sample of the window, as a printing loop shows), or
the mean of all of them (WindowMeanLog: summed on the device as they come, divided at the flush).

A row's `step` counts the steps done, as the checkpoint does: what is logged inside the body of
`for step, batch in run.steps(...)` belongs to step + 1. metrics.jsonl holds one JSON row per
step that logged something; on a resume, the rows after the checkpoint's step (logged before a
crash, about to be redone) are dropped first, so the file reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from expgpu.errors import UserError
from expgpu.loggers.progress import FIELDS, Display, Pace
from expgpu.rundir import METRICS, atomic_write_bytes


def scalar(name: str, value: Any) -> Any:
    """A loggable value (a number or a one-element tensor, detached), or a one-line error."""
    if hasattr(value, "detach"):
        if value.numel() != 1:
            raise UserError(f"run.log({name}=...): a tensor of shape {tuple(value.shape)}; "
                            "log numbers or one-element tensors (e.g. loss.mean())")
        return value.detach()
    if isinstance(value, (int, float)) or hasattr(value, "item"):   # bool, numpy scalars too
        return value
    raise UserError(f"run.log({name}=...): a {type(value).__name__}; log numbers or one-element tensors")


def _number(value: Any) -> float | int:
    v = value.item() if hasattr(value, "item") else value
    return int(v) if isinstance(v, bool) else v   # NaN and inf stay: Python's json reads them back


def trim(path: Path, step: int) -> int:
    """Drop the rows after `step` (all of them for 0), atomically; the last step it held (-1: none)."""
    if not path.exists():
        return -1

    def step_of(line: str) -> int | None:
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):  # a line torn by a kill mid-write
            return None

    lines = path.read_text().splitlines(keepends=True)
    steps = [step_of(line) for line in lines]
    keep = [line for line, s in zip(lines, steps) if s is not None and s <= step]
    if len(keep) != len(lines):
        atomic_write_bytes(path, "".join(keep).encode())
    return max((s for s in steps if s is not None), default=-1)


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows, in file order; a line torn by a kill mid-write, or none, is skipped."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            row = json.loads(line)
            int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        rows.append(row)
    return rows


# What every row holds besides the logged names (and its progress fields, where known, expgpu.loggers.progress):
# a name of these would overwrite or be overwritten.
ROW_KEYS = frozenset({"step", "epoch", "time", *FIELDS})

# Rows reach the OS (a write call) at the first row, then at most this often, and at every
# checkpoint and at the end: rows written out every log_every=10 steps cost a fast CPU loop ~1.5 %
# (bench_run_api's interleaved loop on 1 rank, log_every=10 against 100000).
# Rows still in this process's buffer when it is killed come after the last checkpoint, which a
# resume trims and writes again anyway.
WRITE_EVERY_S = 1.0

# How long ending the loggers' runs waits for another thread that is sending rows or ending them: the main
# thread (its exception path) and the hang watchdog's (a peer failed, expgpu.train.watchdog) may both end
# them, and the watchdog's then ends the process (os._exit), which must not cut the other's end short.
SINKS_WAIT_S = 10.0


class MetricsLog:
    """rank 0's metrics.jsonl and progress display; its sinks (expgpu.loggers.base.Sink: the chosen
    loggers, an optimizing sweeper's trial) are fed the same rows."""

    def __init__(self, run_dir: Path, total_steps: int | None = None, sinks=(), show: bool = True):
        """`show`: the progress on the console (a script's rows are shown by its supervisor instead)."""
        self.path = Path(run_dir) / METRICS
        self.pending: dict[str, tuple[int, Any]] = {}
        self.file = None
        self.show = show
        self.display: Display | None = None
        self.pace = Pace(0, total_steps)
        self.first_epoch = 0
        self.total = total_steps
        self.sinks = list(sinks)
        self.last_row: dict[str, Any] | None = None
        self.written_at: float | None = None   # when rows were last handed to the OS
        self._sinks_lock = threading.Lock()   # the sinks are fed by one thread at a time (SINKS_WAIT_S)
        self._sinks_ended = False

    def open(self, resumed_step: int, total_steps: int | None, resumed: bool = False) -> None:
        """Before the first row: trim what a resume redoes, open for appending, start the sinks."""
        if self.file is None:
            flushed_before = trim(self.path, resumed_step)
            self.file = open(self.path, "a")
            self.pace = Pace(resumed_step, total_steps, self.pace.epochs)
            if self.show:
                self.display = Display(total_steps, resumed_step)
            with self._sinks_lock:
                for sink in self.sinks:
                    sink.start(resumed, resumed_step, flushed_before, self.path)

    def plan(self, max_steps: int | None = None, epochs: int | None = None, first_epoch: int = 0) -> None:
        """What the run's length is, once known (under run.epochs: at each epoch's start)."""
        if max_steps is not None:
            self.pace.max_steps = max_steps
        if epochs is not None:
            self.pace.epochs, self.first_epoch = epochs, first_epoch

    def log(self, step: int, values: dict[str, Any]) -> None:
        # Kept as given (checked at the flush): this runs every step. A tensor kept here holds no
        # activations (backward freed them), only its small graph until it is replaced.
        pending = self.pending
        for name, value in values.items():
            pending[name] = (step, value)

    def _values(self) -> list[tuple[str, int, Any]]:
        """(name, step, number) of each name logged since the last row: read back now."""
        return [(name, step, _number(scalar(name, value))) for name, (step, value) in self.pending.items()]

    def flush(self, epoch: int, to_sinks: bool = True) -> None:
        if not self.pending:
            return
        if self.file is None:
            self.open(0, self.total)
        rows: dict[int, dict[str, Any]] = {}
        for name, step, value in self._values():
            rows.setdefault(step, {})[name] = value
        self.pending.clear()
        now = round(time.time(), 3)
        last = max(rows)
        pace = self.pace.fields(last)
        written = [{"step": step, **rows[step], "epoch": epoch, "time": now, **pace} for step in sorted(rows)]
        for row in written:
            self.file.write(json.dumps(row) + "\n")
        if self.written_at is None or time.monotonic() - self.written_at >= WRITE_EVERY_S:
            self.write_out()
        self.last_row = written[-1]
        if to_sinks and self.sinks:
            with self._sinks_lock:
                if not self._sinks_ended:   # else another thread (the watchdog's) has ended their runs
                    for sink in self.sinks:
                        sink.write(written)
        if self.display is not None:
            self.display.update(last, rows[last], pace, epoch if self.pace.epochs else None, self.first_epoch)

    def append(self, rows: list[dict]) -> None:
        """Rows as they are (an earlier attempt's, kept), handed to the OS now; not sent to the sinks."""
        for row in rows:
            self.file.write(json.dumps(row) + "\n")
        self.write_out()

    def write_out(self) -> None:
        """Hand the rows written so far to the OS (a checkpoint must not come before its rows)."""
        if self.file is not None:
            self.file.flush()
            self.written_at = time.monotonic()

    def state_dict(self) -> list:
        """The values logged since the last row, for the checkpoint: a resumed run writes them at
        the next flush, as the uninterrupted run does, instead of a row at the stop step."""
        return [[name, step, value] for name, step, value in self._values()]

    def load_state_dict(self, state: list) -> None:
        # [name, step, sum, count] entries: a checkpoint of log_reduce=mean (a resume may change it)
        self.pending = {name: (int(step), value / n[0] if n and n[0] != 1 else value)
                        for name, step, value, *n in state}

    def close(self, epoch: int, flush: bool = True, crashed: bool = False) -> None:
        if flush:
            # After a crash the last row is off the log_every cadence (the step it crashed at): kept
            # in metrics.jsonl, where a resume trims it, but not sent to loggers, which cannot take
            # a point back; a resume sends them the rows from the checkpoint on.
            self.flush(epoch, to_sinks=not crashed)
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.display is not None:
            self.display.close()

    def finish_loggers(self, status: str, metrics: dict, step: int) -> None:
        """After the function: the sinks get its outcome (finished, stopped, failed) and returned metrics,
        once: a second caller (another thread) waits for the first one's end and adds nothing."""
        if not self._sinks_lock.acquire(timeout=SINKS_WAIT_S):
            return   # another thread is stuck sending (a lost tracking server): this one cannot end the runs
        try:
            if self._sinks_ended:
                return
            self._sinks_ended = True
            for sink in self.sinks:
                sink.finish(status, metrics, step, self.last_row)
        finally:
            self._sinks_lock.release()


class WindowMeanLog(MetricsLog):
    """task.log_reduce=mean: a row holds the mean of each name's values logged since the last row.

    Values are added up as they come, tensors on their device (no read-back: the sum is read at the
    flush, as MetricsLog reads its last value), in float32 at least; a name logged once since the
    last row (an evaluation) keeps its one value as logged. The checkpoint holds each (sum, count):
    a run stopped in the middle of a window and resumed writes the uninterrupted run's mean."""

    def log(self, step: int, values: dict[str, Any]) -> None:
        pending = self.pending
        for name, value in values.items():
            value = scalar(name, value)   # checked now: a sum of strings or vectors is no mean to report
            if not hasattr(value, "detach"):
                value = _number(value)    # NumPy's bools add as `or`: Python numbers add as numbers
            held = pending.get(name)
            if held is None:
                pending[name] = [step, value, 1]
            else:
                held[0], held[1], held[2] = step, _widened(held[1]) + _widened(value), held[2] + 1

    def _values(self) -> list[tuple[str, int, Any]]:
        out = []
        for name, (step, total, count) in self.pending.items():
            value = _number(total)
            out.append((name, step, value if count == 1 else value / count))
        return out

    def state_dict(self) -> list:
        return [[name, step, _number(total), count] for name, (step, total, count) in self.pending.items()]

    def load_state_dict(self, state: list) -> None:
        # [name, step, value] entries: a checkpoint of log_reduce=last, its value a window of one
        self.pending = {name: [int(step), value, n[0] if n else 1] for name, step, value, *n in state}


def _widened(value: Any) -> Any:
    """A tensor to add up in float32 at least: bf16 and fp16 sums lose digits within a few dozen
    terms, bool tensors add as `or`, small integers overflow. Python numbers as they are."""
    if hasattr(value, "is_floating_point") and (not value.is_floating_point() or value.element_size() < 4):
        return value.float()
    return value
