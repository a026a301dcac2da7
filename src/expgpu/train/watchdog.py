"""The progress watchdog of a run of several ranks: a hung rank found and named, with its stack.

A rank that stops (its data loader stuck, a dead file system, a deadlock, a collective its peers never
reach) leaves every other rank waiting in a collective until the process group's timeout, and the
error then names the collective and blames a rank that waited. Here every rank runs a thread that,
once a second, publishes where its loop is (its step, its phase, how long since the step last
advanced) in the process group's store, so it works alike under expgpu's spawn, torchrun and srun,
on one node or many. Two ranks (the first and the last) read everyone's; the loop itself pays nothing
(the thread reads `run.step`).

It is a hang when every rank still training has not finished a step for its limit: `launch.hang.timeout_s`,
or by default 20 x the slowest rank's recent step time, at least FLOOR_S; a rank in a slow phase (its
first step, which may compile; a checkpoint save; a `with run.phase(...)` block, the built-in loop's
evaluation) has at least `launch.hang.slow_phase_s`. The watcher that sees it first claims the verdict
(compare-and-set in the store); then every rank writes its threads' stacks to RUN_DIR/hang/rank<N>.txt
and the frame of its own code to the store, the claimer writes the verdict (RUN_DIR/hang/verdict.json,
result.json with status "hung", through `on_verdict`), and every rank exits with EXIT_HUNG, which frees
its GPUs at once. A rank whose watchdog cannot run (a C call holding the GIL) stops refreshing its
record, which counts as not advancing; faulthandler dumps its stacks and ends it on its own a while
after its limit (RUN_DIR/.expgpu/backstop-rank<N>.txt).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from expgpu import rundir
from expgpu.errors import EXIT_HUNG
from expgpu.procs import stacks

log = logging.getLogger("expgpu")

PERIOD_S = 1.0         # how often a rank publishes where it is, and a watcher judges
FLOOR_S = 60.0         # auto: the limit is never below this
STEP_FACTOR = 20       # auto: this many of the slowest rank's recent step time
FRAMES_WAIT_S = 3.0    # the claimer waits this long for every rank's frame before it writes the verdict
BACKSTOP_S = 60.0      # faulthandler ends a rank whose watchdog could not run this long after its limit
PREFIX = "expgpu/watchdog"
DONE = "done"       # a rank whose loop is over: no hang of its own while it waits for its peers
FAILED = "failed"   # a rank whose task raised: its peers stop now (its own process may be slow to end)


@dataclass(frozen=True)
class HangSettings:
    timeout_s: float | None   # None: auto
    slow_phase_s: float


def settings(cfg: dict) -> HangSettings | None:
    """launch.hang as settings; None when the watchdog is off (timeout_s: null)."""
    hang = cfg["launch"].get("hang") or {}
    timeout = hang.get("timeout_s", "auto")
    if timeout is None:
        return None
    return HangSettings(None if timeout == "auto" else float(timeout), float(hang.get("slow_phase_s", 600.0)))


def limit(s: HangSettings, phase: str, step_s: float | None) -> float:
    """How long a rank in `phase` may go without finishing a step."""
    base = s.timeout_s if s.timeout_s is not None else max(FLOOR_S, STEP_FACTOR * (step_s or 0.0))
    return base if phase == "train" else max(base, s.slow_phase_s)


def judge(records: dict[int, dict], s: HangSettings) -> dict | None:
    """The verdict on everyone's records ({rank: {step, phase, age, step_s}}), or None: no hang.
    A rank that failed is a verdict at once: its peers would wait for it in their next collective."""
    failed = sorted(r for r, rec in records.items() if rec["phase"] == FAILED)
    if failed:
        return {"failed": failed}
    active = {r: rec for r, rec in records.items() if rec["phase"] != DONE}
    if not active:
        return None
    slowest = max((rec.get("step_s") or 0.0) for rec in active.values())
    over = {r: rec["age"] > limit(s, rec["phase"], slowest) for r, rec in active.items()}
    if not all(over.values()):
        return None
    top = max(rec["step"] for rec in active.values())
    behind = sorted(r for r, rec in active.items() if rec["step"] < top) or sorted(active)
    oldest = max(active[r]["age"] for r in behind)
    return {"behind": behind, "step": min(active[r]["step"] for r in behind) + 1, "waited_s": round(oldest, 1),
            "limit_s": round(limit(s, active[behind[0]]["phase"], slowest), 1),
            "ranks": {str(r): {"step": rec["step"], "phase": rec["phase"]} for r, rec in sorted(active.items())}}


# Where a rank waits for its peers, by the innermost Python function it is in: a rank found there is
# waiting, not the one at fault (a DDP backward waits in the C++ engine, for the gradients' all-reduce).
WAITING = ("_engine_run_backward", "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
           "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce_scatter",
           "reduce_scatter_tensor", "gather_object", "scatter_object_list", "wait", "synchronize", "all_to_all")


def waiting(frame: dict | None) -> bool:
    return bool(frame and frame.get("inside") and frame["inside"].split("'s ")[-1] in WAITING)


def culprits(verdict: dict, frames: dict[int, dict]) -> list[int]:
    """The rank(s) at fault: those behind the others' step, else, all at one step, those not waiting
    in a collective (by their frames); all of them when that tells nothing."""
    behind = verdict["behind"]
    if len(behind) < len(verdict["ranks"]):
        return behind
    stuck = [r for r in behind if not waiting(frames.get(r))]
    return stuck if 0 < len(stuck) < len(behind) else behind


def line(verdict: dict, frames: dict[int, dict]) -> str:
    """The one line a hang prints: the rank(s) at fault, the step, their own frame, where the others wait."""
    ranks = sorted(int(r) for r in verdict["ranks"])
    behind = culprits(verdict, frames)
    who = ", ".join(f"rank {r}" for r in behind)
    if len(behind) < len(ranks):
        head = f"{who} {'has' if len(behind) == 1 else 'have'} not finished step {verdict['step']}"
    else:
        head = f"no rank has finished step {verdict['step']}"
    parts = [f"{head} for {verdict['waited_s']:.0f} s (limit {verdict['limit_s']:.0f} s)"]
    parts += [f"rank {r} at {_frame(frames.get(r))}" for r in behind]
    others = [r for r in ranks if r not in behind]
    if others:
        where = {_frame(frames.get(r), short=True) for r in others}
        parts.append(f"the others ({', '.join(f'rank {r}' for r in others)}) wait {' / '.join(sorted(where))}")
    return "; ".join(parts)


def _frame(frame: dict | None, short: bool = False) -> str:
    if frame is None:
        return "an unknown place (its watchdog could not run: a C call holding the GIL? see RUN_DIR/hang/)"
    own, inside = frame.get("own"), frame.get("inside")
    if short:
        return f"in {inside}" + (f" at {own}" if own else "") if inside else f"at {own}" if own else "in expgpu's code"
    return f"{own or 'no frame of your code'}" + (f" (in {inside})" if inside else "")


class Watchdog:
    """One rank's thread. `where()`: (the run's step, its phase); `on_verdict(verdict, line)`: run by the
    rank that claimed the verdict, before every rank exits."""

    def __init__(self, store, rank: int, world_size: int, run_dir: Path, s: HangSettings,
                 where: Callable[[], tuple[int, str]], on_verdict: Callable[[dict, str], None]):
        self.store = store.clone()   # a connection of its own: the loop's collectives keep theirs
        self.rank, self.world, self.run_dir, self.s = rank, world_size, Path(run_dir), s
        self.where, self.on_verdict = where, on_verdict
        self.watcher = rank in (0, world_size - 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="expgpu-watchdog", daemon=True)
        self._seen: dict[int, tuple[int, float]] = {}   # a watcher's: rank -> (its record's seq, when it changed)
        self._step, self._advanced, self._seq, self._step_s = None, time.monotonic(), 0, None
        self._backstop = None

    def start(self) -> "Watchdog":
        self._arm_backstop()
        self._thread.start()
        return self

    def done(self, failed: bool = False) -> None:
        """This rank's loop is over (it may still wait for its peers): not a hang of its own. `failed`:
        its task raised, and its peers are told to stop at once."""
        if self._stop.is_set() and not failed:
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        try:
            self._publish(FAILED if failed else DONE)
        except Exception:   # the store's host (rank 0) may be gone already
            pass
        faulthandler.cancel_dump_traceback_later()
        if self._backstop is not None:
            self._backstop.close()
            path = Path(self._backstop.name)
            if path.exists() and path.stat().st_size == 0:
                path.unlink()

    def _loop(self) -> None:
        failing_since = None
        while not self._stop.wait(PERIOD_S):
            try:
                self._tick()
                failing_since = None
            except Exception as e:   # the store unreachable: its host, rank 0, is gone, or the network
                if failing_since is None:
                    log.warning("rank %d: the hang watchdog cannot reach the run's store (%s)", self.rank, e)
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > limit(self.s, "train", self._step_s):
                    self._alone(e)

    def _tick(self) -> None:
        step, phase = self.where()
        now = time.monotonic()
        if step != self._step:
            if self._step is not None and step > self._step:
                took = (now - self._advanced) / (step - self._step)
                self._step_s = took if self._step_s is None else max(took, 0.9 * self._step_s)
            self._step, self._advanced = step, now
        self._publish(phase)
        self._arm_backstop()
        key = f"{PREFIX}/verdict"
        if self.store.check([key]):
            self._act(json.loads(self.store.get(key)), claimed=False)
        if self.watcher:
            verdict = judge(self._records(), self.s)
            if verdict is not None:
                verdict["by"] = self.rank
                mine = json.dumps(verdict)
                if self.store.compare_set(key, "", mine).decode() == mine:
                    self._act(verdict, claimed=True)
                else:
                    self._act(json.loads(self.store.get(key)), claimed=False)

    def _publish(self, phase: str) -> None:
        self._seq += 1
        self.store.set(f"{PREFIX}/hb/{self.rank}", json.dumps(
            {"step": self._step if self._step is not None else -1, "phase": phase, "seq": self._seq,
             "age": round(time.monotonic() - self._advanced, 3), "step_s": self._step_s}))

    def _records(self) -> dict[int, dict]:
        """Everyone's record, its age grown by the time since it was last refreshed (a rank whose
        watchdog cannot run does not refresh it)."""
        keys = [f"{PREFIX}/hb/{r}" for r in range(self.world)]
        if not self.store.check(keys):
            return {}   # a rank not started yet: no verdict before everyone has spoken
        now = time.monotonic()
        out = {}
        for r, raw in enumerate(self.store.multi_get(keys)):
            rec = json.loads(raw)
            seq, since = self._seen.get(r, (None, now))
            if rec["seq"] != seq:
                seq, since = rec["seq"], now
            self._seen[r] = (seq, since)
            rec["age"] = rec["age"] + (now - since)
            out[r] = rec
        return out

    def _act(self, verdict: dict, claimed: bool) -> None:
        """Stacks to disk, this rank's frame to the store; the claimer writes the verdict; then exit.
        A peer's failure: nothing to say (its own record does), just stop waiting for it."""
        self._stop.set()
        if "failed" in verdict:
            log.error("rank %d: stopping: rank(s) %s failed (their error is their own record)", self.rank,
                      ", ".join(map(str, verdict["failed"])))
            _exit(1)
        faulthandler.cancel_dump_traceback_later()
        header = (f"rank {self.rank} (pid {os.getpid()}, {socket.gethostname()}), step {self._step}, "
                  f"phase {self.where()[1]}; the run hung: {json.dumps(verdict)}")
        frame = stacks.dump(rundir.hang_stack(self.run_dir, self.rank), header, skip=threading.get_ident())
        self.store.set(f"{PREFIX}/frame/{self.rank}", json.dumps(frame))
        if claimed:
            frames = self._frames(verdict)
            text = line(verdict, frames)
            verdict["culprits"] = culprits(verdict, frames)
            verdict["frames"] = {str(r): f for r, f in frames.items()}
            verdict["line"] = text
            self.on_verdict(verdict, text)
            self.store.set(f"{PREFIX}/written", "1")
        else:
            self._wait_for([f"{PREFIX}/written"], FRAMES_WAIT_S + 5)
        self.store.set(f"{PREFIX}/leaving/{self.rank}", "1")
        if self.rank == 0:   # the store's host, where it is expgpu's: the others first, or they lose it mid-call
            self._wait_for([f"{PREFIX}/leaving/{r}" for r in range(1, self.world)], 5)
        _exit()

    def _wait_for(self, keys: list[str], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.1)

    def _frames(self, verdict: dict) -> dict[int, dict]:
        ranks = [int(r) for r in verdict["ranks"]]
        deadline = time.monotonic() + FRAMES_WAIT_S
        while time.monotonic() < deadline and not self.store.check([f"{PREFIX}/frame/{r}" for r in ranks]):
            time.sleep(0.1)
        return {r: json.loads(self.store.get(f"{PREFIX}/frame/{r}")) for r in ranks
                if self.store.check([f"{PREFIX}/frame/{r}"])}

    def _alone(self, error: Exception) -> None:
        """The store is gone: no verdict to share; this rank says where it is and ends."""
        stacks.dump(rundir.hang_stack(self.run_dir, self.rank),
                    f"rank {self.rank}: the run's store stopped answering ({error}); its host, rank 0, is gone?",
                    skip=threading.get_ident())
        log.error("rank %d: the run's store stopped answering (%s): ending this rank", self.rank, error)
        _exit()

    def _arm_backstop(self) -> None:
        """faulthandler's own thread ends this rank if this one cannot run (re-armed at every tick)."""
        if self._backstop is None:
            path = rundir.backstop_file(self.run_dir, self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._backstop = open(path, "w")
        phase = self.where()[1]
        seconds = limit(self.s, phase, self._step_s) + BACKSTOP_S
        faulthandler.dump_traceback_later(seconds, exit=True, file=self._backstop)


def _exit(code: int = EXIT_HUNG) -> None:
    """End this rank at once: its main thread is stuck (and holds the GPU); flush the logs first."""
    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except Exception:
            pass
    os._exit(code)


def start(store, rank: int, world_size: int, run_dir: Path, s: HangSettings | None, where, on_verdict):
    """The rank's watchdog, started; None for one rank or when it is off."""
    if s is None or world_size < 2 or store is None:
        return None
    return Watchdog(store, rank, world_size, run_dir, s, where, on_verdict).start()


__all__ = ["EXIT_HUNG", "HangSettings", "Watchdog", "judge", "limit", "line", "settings", "start"]
