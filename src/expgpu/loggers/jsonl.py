"""What `run.log` records: rank 0's scalars, read back only when they are written.

A logged tensor stays on its device until a flush (every `task.log_every` steps, at a stop, at
the end). There a GPU value's copy to the host is started (non-blocking, with an event), and the
rows are put into words and written at most every WRITE_EVERY_S (and at every checkpoint, stop and
end), when the copies have long arrived: the loop never waits for the GPU to log, where a plain
PyTorch loop's `loss.item()` does at every print. Between two flushes each name keeps one value and
the step it was last logged at, so a metric logged every step costs one copy per flush, and one
logged at an odd step (an evaluation) is still written, at its own step. Which value
(`task.log_reduce`): the last one logged (MetricsLog, the default: a row is a sample of the window,
as a printing loop shows), or the mean of all of them (WindowMeanLog: summed on the device as they
come, divided when read).

A row's `step` counts the steps done, as the checkpoint does: what is logged inside the body of
`for step, batch in run.steps(...)` belongs to step + 1. metrics.jsonl holds one JSON row per
step that logged something; on a resume, the rows after the checkpoint's step (logged before a
crash, about to be redone) are dropped first, so the file reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from expgpu.errors import UserError
from expgpu.loggers.nonfinite import NonFinite
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


class _Copy:
    """A GPU value on its way to the host: the copy and an event queued at the flush, read at the
    write-out (a second or so later, long done: no wait for the GPU on the training loop's thread)."""

    __slots__ = ("host", "event", "divisor")

    def __init__(self, value: Any, divisor: int):
        import torch

        self.host = value.detach().to("cpu", non_blocking=True)   # into pinned memory: a true async copy
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(value.device))
        self.divisor = divisor

    def arrived(self) -> bool:
        try:
            return self.event.query()
        except Exception:   # a broken CUDA context (after a crash): never
            return False

    def number(self) -> float | int:
        self.event.synchronize()
        v = _number(self.host)
        return v if self.divisor == 1 else v / self.divisor


def _read_later(value: Any, divisor: int = 1) -> Any:
    """`value` / divisor as a number, or a GPU tensor's _Copy (read at the write-out)."""
    if getattr(value, "is_cuda", False):
        return _Copy(value, divisor)
    v = _number(value)
    return v if divisor == 1 else v / divisor


def _read(value: Any) -> float | int:
    return value.number() if isinstance(value, _Copy) else value


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
# run.log's and expgpu.log's forms, as their refusal of another one lists them
LOG_FORMS = ("name=value pairs (loss=loss), a name and a value ('loss', loss) or a dict of names to values "
             "({'loss': loss})")


def positional_values(named: tuple) -> dict | None:
    """A log call's positional values as name -> value, in the forms other tools take them: a name and a value
    (Lightning's self.log("loss", loss)) or a dict (wandb.log, accelerate.log); None for any other form."""
    if len(named) == 2 and isinstance(named[0], str):
        return {named[0]: named[1]}
    if len(named) == 1 and isinstance(named[0], dict) and all(isinstance(k, str) for k in named[0]):
        return dict(named[0])
    return None

# Rows are put into words, written and handed to the OS (and to the sinks, the progress display) at
# the first row, then at most this often, and at every checkpoint, stop and end. At every flush
# (log_every=10 steps) it cost a fast CPU loop 2-3 % of its steps/s, most of it the formatting
# code run cold between steps (bench_run_api's interleaved loop on 1 rank); once a second, its
# rows together, it is noise. A row a sink wants at once (Sink.prompt: a pruner's objective) is
# written at its flush. Rows not yet written when the process is killed come after the last
# checkpoint, which a resume trims and writes again anyway.
WRITE_EVERY_S = 1.0

# After a crash, how long the last rows wait for their GPU values (a broken CUDA context never delivers them).
CRASH_WAIT_S = 2.0

# How long ending the loggers' runs waits for another thread that is sending rows or ending them: the main
# thread (its exception path) and the hang watchdog's (a peer failed, expgpu.train.watchdog) may both end
# them, and the watchdog's then ends the process (os._exit), which must not cut the other's end short.
SINKS_WAIT_S = 10.0


class MetricsLog:
    """rank 0's metrics.jsonl and progress display; its sinks (expgpu.loggers.base.Sink: the chosen
    loggers, an optimizing sweeper's trial) are fed the same rows."""

    def __init__(self, run_dir: Path, total_steps: int | None = None, sinks=(), show: bool = True,
                 nonfinite: NonFinite | None = None):
        """`show`: the progress on the console (a script's rows are shown by its supervisor instead);
        `nonfinite`: what a loss or a score written as nan or inf does (said; under task.on_nonfinite=stop, the
        run stopped: expgpu.train.run hands it that NonFinite)."""
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
        # flushed, not yet written: ([(name, step, number or _Copy)], epoch, time, monotonic, to the sinks,
        # seconds waited for data or None)
        self.unwritten: list[tuple[list, int, float, float, bool, float | None]] = []
        self._rows_lock = threading.Lock()   # the loop's flush, and write_out from the watchdog's thread
        self._prompt = frozenset().union(*(getattr(s, "prompt", ()) for s in self.sinks))
        self._sinks_lock = threading.Lock()   # the sinks are fed by one thread at a time (SINKS_WAIT_S)
        self._sinks_ended = False
        # the seconds the loop has waited for its batches so far, once it takes them from a loader (expgpu.train.run)
        self.waited: Callable[[], float] | None = None
        # a loss or a score that became nan or inf: said once, its step kept (and the run stopped, if so asked)
        self.nonfinite = nonfinite or NonFinite()

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
        """(name, step, number) of each name logged since the last row: read back now (a checkpoint's)."""
        return [(name, step, _read(value)) for name, step, value in self._taken()]

    def _taken(self) -> list[tuple[str, int, Any]]:
        """(name, step, number or _Copy) of each name logged since the last row: checked now, read later."""
        return [(name, step, _read_later(scalar(name, value))) for name, (step, value) in self.pending.items()]

    def flush(self, epoch: int, to_sinks: bool = True) -> None:
        """The names logged since the last row make a row (one per step they were logged at), written
        now or at the next write-out. to_sinks=False: metrics.jsonl's alone."""
        if not self.pending:
            return
        if self.file is None:
            self.open(0, self.total)
        taken = self._taken()
        self.pending.clear()
        with self._rows_lock:
            self.unwritten.append((taken, epoch, round(time.time(), 3), time.monotonic(), to_sinks,
                                   self.waited() if self.waited is not None else None))
        if (self.written_at is None or time.monotonic() - self.written_at >= WRITE_EVERY_S
                or (self._prompt and any(name in self._prompt for name, _, _ in taken))):
            self.write_out()

    def append(self, rows: list[dict]) -> None:
        """Rows as they are (an earlier attempt's, kept), handed to the OS now; not sent to the sinks."""
        self.write_out()   # the rows flushed before them go first
        for row in rows:
            self.file.write(json.dumps(row) + "\n")
        self.write_out()

    def write_out(self, wait: bool = True) -> None:
        """The rows flushed so far written and handed to the OS, then sent to the sinks and the display (a
        checkpoint must not come before its rows). wait=False (the watchdog's thread, the loop's may be stuck
        on the GPU): only the rows whose values have arrived, in order."""
        with self._rows_lock:
            if self.file is None:
                return
            n = len(self.unwritten)
            if not wait:
                n = next((i for i, entry in enumerate(self.unwritten)
                          if not all(v.arrived() for _, _, v in entry[0] if isinstance(v, _Copy))), n)
            entries, self.unwritten = self.unwritten[:n], self.unwritten[n:]
            made = [self._rows(*entry) for entry in entries]
            for rows, _ in made:
                for row in rows:
                    self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            self.written_at = time.monotonic()
        if not made:
            return
        for rows, _ in made:
            self.nonfinite.check(rows, ROW_KEYS)
        self.last_row = made[-1][0][-1]
        sent = [row for rows, to_sinks in made if to_sinks for row in rows]
        if sent and self.sinks:
            with self._sinks_lock:
                if not self._sinks_ended:   # else another thread (the watchdog's) has ended their runs
                    for sink in self.sinks:
                        sink.write(sent)
        if self.display is not None:
            row = self.last_row
            values = {k: v for k, v in row.items() if k not in ROW_KEYS}
            pace = {k: row[k] for k in FIELDS if k in row}
            self.display.update(row["step"], values, pace, row["epoch"] if self.pace.epochs else None, self.first_epoch)

    def _await_copies(self, seconds: float) -> None:
        """Until every GPU value flushed has reached the host, or `seconds` have passed."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self._rows_lock:
                copies = [v for entry in self.unwritten for _, _, v in entry[0] if isinstance(v, _Copy)]
            if all(c.arrived() for c in copies):
                return
            time.sleep(0.01)

    def _rows(self, taken: list, epoch: int, wall: float, at: float, to_sinks: bool,
              waited: float | None) -> tuple[list[dict], bool]:
        """One flush's rows, in words (its values read: arrived long ago)."""
        rows: dict[int, dict[str, Any]] = {}
        for name, step, value in taken:
            rows.setdefault(step, {})[name] = _read(value)
        pace = self.pace.fields(max(rows), at, waited)
        return [{"step": step, **rows[step], "epoch": epoch, "time": wall, **pace} for step in sorted(rows)], to_sinks

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
        if crashed:   # the GPU may never deliver (a broken CUDA context): the rows whose values arrive soon
            self._await_copies(CRASH_WAIT_S)
        self.write_out(wait=not crashed)
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

    def _taken(self) -> list[tuple[str, int, Any]]:
        return [(name, step, _read_later(total, count)) for name, (step, total, count) in self.pending.items()]

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
