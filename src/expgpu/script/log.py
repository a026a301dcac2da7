"""expgpu.log(**scalars): the one line a script task may add for metrics; no Run needed.

    import expgpu
    expgpu.log(loss=loss.item(), lr=lr, step=iter_num)      # step= optional: else 0, 1, 2, ...
    expgpu.log({"loss": loss.item()}, step=iter_num)        # as wandb.log; or expgpu.log("loss", loss.item())
    expgpu.log(loss=..., step=iter_num, max_steps=max_iters)  # max_steps=: the progress's total and ETA

In a script expgpu runs (EXPGPU_SCRIPT_RUN_DIR, set by expgpu.script.environ), on rank 0 (RANK 0 or
unset), it appends a row to the run dir's metrics.jsonl through expgpu.loggers.jsonl.MetricsLog, the writer
run.log uses: the same row format ({"step", names..., "epoch", "time"}), handed to the OS at most once
a second and at the script's exit; rank 0's supervisor gives the rows to the chosen loggers and shows the
progress (step, pace; with `max_steps=`, given once, the share done and the time left). `epoch=`
sets the row's epoch (kept for later rows). On every rank of a script expgpu runs, each call is also the
rank's heartbeat (expgpu.script.heartbeat: two numbers stored in shared memory, no I/O), which its supervisor
watches for hangs (expgpu.script.watch): on other ranks that is all it does. Anywhere else (plain python
or torchrun) it does nothing, after one look at the environment.

A rerun that resumed the script (resume_args added) continues the history: without step=, at the
step after the last row; with step=, the rows after its first step are dropped first (logged after the
checkpoint the script resumed from, about to be logged again). Those at its first step are held back
until it logs another step or exits: what it logs there again replaces them, the rest stays (a script
resumed at its checkpoint's step that evaluates there again, at its start or its end, keeps the loss
logged there). They wait in RUN_DIR/.expgpu/script-held-rows.jsonl, so an attempt killed before then
loses none of them: the next attempt puts them back first. A rerun that starts the script afresh starts
metrics.jsonl afresh.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from pathlib import Path

from expgpu import envvars
from expgpu.loggers.base import Sink
from expgpu.loggers.jsonl import LOG_FORMS, ROW_KEYS, MetricsLog, positional_values, read_rows, trim
from expgpu.loggers.nonfinite import NonFinite
from expgpu.procs.stop_signals import NEVER
from expgpu.rundir import METRICS, atomic_write_bytes, script_held_rows, script_log_marker
from expgpu.script.heartbeat import Beat

# Set by expgpu.script.environ in the script's environment
ENV_RUN_DIR = envvars.SCRIPT_RUN_DIR
ENV_RESUMED = envvars.SCRIPT_RESUMED
_sink = None   # None: not looked yet; False: logging nowhere
_beat: Beat | None = None


def log(*named, step: int | None = None, max_steps: int | None = None, **scalars) -> None:
    """Record numbers (or one-element tensors) for a step; `max_steps`: the run's length, for its progress
    (step 60/200, the time left); see the module's docstring. As run.log, also in other tools' forms:
    expgpu.log("loss", loss), expgpu.log({"loss": loss}, step=i) (wandb.log's)."""
    global _sink, _beat
    if named and len(named) <= 2 and all(type(v) is int for v in named) and step is None and max_steps is None:
        step, max_steps = (*named, None)[:2]   # the first form, expgpu.log(step[, max_steps], **scalars)
    elif named:   # checked on every rank and outside expgpu too: a wrong call fails where it was written
        values = positional_values(named)
        if values is None:
            raise TypeError(f"expgpu.log({', '.join(type(v).__name__ for v in named)}): give {LOG_FORMS}; "
                            "step= and max_steps= by name")
        scalars = {**values, **scalars}
    if _sink is None:
        _sink = _ScriptLog.from_env(os.environ) or False
        _beat = Beat.from_env(os.environ)
    if _sink:
        step = _sink.log(step, scalars, max_steps)
    if _beat is not None:
        _beat.beat(step)


class _Prompt(Sink):
    """A trial's objective (its rows to metrics.jsonl at once, where rank 0's supervisor reports them to the
    study's pruner, not up to a second later with the other rows); the rows go nowhere else from here."""

    def __init__(self, name: str):
        self.prompt = frozenset({name})

    @staticmethod
    def of(env) -> _Prompt | None:
        name = env.get(envvars.SCRIPT_PROMPT)   # set by rank 0's supervisor, which reports to the trial
        return _Prompt(name) if name else None

    def write(self, rows: list[dict]) -> None:
        pass


class _ScriptLog:
    @staticmethod
    def from_env(env) -> _ScriptLog | None:
        run_dir = env.get(ENV_RUN_DIR)
        if not run_dir or env.get("RANK", "0").strip() not in ("0", ""):
            return None
        return _ScriptLog(Path(run_dir), env.get(ENV_RESUMED) == "1", _Prompt.of(env))

    def __init__(self, run_dir: Path, resumed: bool, prompt: Sink | None = None):
        self.run_dir, self.resumed = run_dir, resumed
        # rank 0's supervisor shows the progress (script.loggers), and reports a trial's objective to its pruner
        self.metrics = MetricsLog(run_dir, show=False, sinks=[prompt] if prompt else (),
                                  nonfinite=NonFinite(script=True))
        self.next_step: int | None = None
        self.held: list[dict] = []   # an earlier attempt's rows at this attempt's first step, held back
        self.epoch = 0
        self.lock = threading.Lock()
        atexit.register(self.close)

    def log(self, step: int | None, values: dict, max_steps: int | None = None) -> int:
        """The row's step (given, or the one after the last)."""
        if max_steps is not None:
            if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
                raise ValueError(f"expgpu.log(max_steps={max_steps!r}): the run's steps in all, an integer >= 1")
            self.metrics.plan(max_steps=max_steps)
        if "epoch" in values:
            self.epoch = values.pop("epoch")
        taken = ROW_KEYS & values.keys()
        if taken:
            raise ValueError(f"expgpu.log({next(iter(taken))}=...): a row's own key; log it under another name")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"expgpu.log(step={step!r}): an integer, or leave it out (then 0, 1, 2, ...)")
        with self.lock:
            if self.metrics.file is None:
                self._begin(step)
            step = self.next_step if step is None else step
            if self.held:
                self._hold_back(step, values.keys())
            self.metrics.log(step, values)
            self.metrics.flush(self.epoch)
            self.next_step = step + 1
        return step

    def _begin(self, first: int | None) -> None:
        """Trim what this attempt redoes, open metrics.jsonl, and say where its rows begin (expgpu.script.loggers)."""
        path = self.run_dir / METRICS
        _put_back(path, script_held_rows(self.run_dir))
        held = trim(path, NEVER)   # the last step an earlier attempt logged; nothing dropped
        if not self.resumed:
            kept = -1
        else:
            kept = held if first is None else first - 1
        if self.resumed and first is not None:
            self.held = [row for row in read_rows(path) if row["step"] == first]
            if self.held:   # kept safe before the trim drops them from metrics.jsonl
                atomic_write_bytes(script_held_rows(self.run_dir), _lines(self.held))
        self.metrics.open(kept, None, resumed=self.resumed)
        self.next_step = kept + 1
        self.metrics.write_out()
        begun = {"resumed": self.resumed, "step": max(kept, 0), "flushed_before": held,
                 "offset": path.stat().st_size}
        marker = script_log_marker(self.run_dir)
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(marker, json.dumps(begun).encode())

    def _hold_back(self, step: int | None, names) -> None:
        """At the held rows' step: drop what is logged again. At another (None: the end): write the rest,
        before the new row."""
        if step == self.held[0]["step"]:
            self.held = _without(self.held, names)
            if self.held:
                return
        self.metrics.append(self.held)
        self.held = []
        script_held_rows(self.run_dir).unlink(missing_ok=True)   # after the rows reached the OS

    def close(self) -> None:
        with self.lock:
            if self.metrics.file is not None:
                if self.held:
                    self._hold_back(None, ())
                self.metrics.close(self.epoch)


def _without(rows: list[dict], names) -> list[dict]:
    """`rows` without the metrics `names` (a row's own keys stay), and without the rows left with none."""
    cut = [{k: v for k, v in row.items() if k not in names or k in ROW_KEYS} for row in rows]
    return [row for row in cut if row.keys() - ROW_KEYS]


def _lines(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _put_back(path: Path, held_path: Path) -> None:
    """Rows an attempt killed at its first step held back: appended to metrics.jsonl, but for the names it
    logged there again (newer), or all of them where it went on past that step (it wrote them then)."""
    held = read_rows(held_path)
    if held:
        step = held[0]["step"]
        rows = read_rows(path)
        logged = {name for row in rows if row["step"] == step for name in row}
        if all(row["step"] <= step for row in rows):
            back = _without(held, logged)
            if back:
                with open(path, "ab") as f:
                    f.write(_lines(back))
                    f.flush()
                    os.fsync(f.fileno())
    held_path.unlink(missing_ok=True)
