"""The progress watchdog of a run: a hung rank found and named, with its stack.

A rank that stops (its data loader stuck, a dead file system, a deadlock, a collective its peers never
reach) leaves every other rank waiting in a collective until the process group's timeout, and the
error then names the collective and blames a rank that waited. Here every rank runs a thread that,
once a second, publishes where its loop is (its step, its phase, how long since the step last
advanced) in the process group's store, so it works alike under expgpu's spawn, torchrun and srun,
on one node or many. Two ranks (the first and the last) read everyone's; the loop itself pays nothing
(the thread reads `run.step`). A run of one rank (a sweep's trial, most often) has no process group and
no collective whose timeout would end it: it keeps its records in a store of its own, by the same rules,
so a trial that stops making progress frees its GPU and its pool slot instead of holding them for ever.

It is a hang when every rank still training has not finished a step for its limit: `launch.hang.timeout_s`,
or by default 20 x the slowest rank's recent step time, at least FLOOR_S; a rank in a slow phase (its
first step, which may compile; a checkpoint save; a `with run.phase(...)` block, the built-in loop's
evaluation; its own code between epochs or after run.steps) has at least `launch.hang.slow_phase_s`.
Ranks whose run.steps has not begun (setup; a task that uses no run.steps) are not judged until one has
begun: its step is the only progress expgpu can see. The watcher that sees it first claims the verdict
(compare-and-set in the store); then every rank writes its threads' stacks to RUN_DIR/hang/rank<N>.txt
and the frame of its own code to the store, the claimer writes the verdict (RUN_DIR/hang/verdict.json,
result.json with status "hung", through `on_verdict`), and every rank exits with EXIT_HUNG, which frees
its GPUs at once. A rank whose watchdog cannot run (a C call holding the GIL) stops refreshing its
record, which counts as not advancing; faulthandler dumps its stacks and ends it on its own a while
after its limit (RUN_DIR/.expgpu/backstop-rank<N>.txt).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from expgpu import rundir
from expgpu.errors import EXIT_HUNG, EXIT_PEER_FAILED, first_line, short
from expgpu.procs import stacks
from expgpu.procs.hang_rules import (
    DONE,
    FAILED,
    FLOOR_S,
    STEP_FACTOR,
    HangSettings,
    culprits,
    ended,
    held_up,
    judge,
    limit,
    line,
    settings,
    waiting,
)

log = logging.getLogger("expgpu")

PERIOD_S = 1.0         # how often a rank publishes where it is, and a watcher judges
# the claimer waits up to this long for every rank's frame before it writes the verdict: a peer learns of the
# verdict at its next tick (<= PERIOD_S) and then dumps its stacks, 3.4 s in all seen on a loaded machine; only
# a rank whose watchdog cannot run (a frame that never comes) makes the wait this long
FRAMES_WAIT_S = 10.0
BACKSTOP_S = 60.0      # faulthandler ends a rank whose watchdog could not run this long after its limit
READ_S = 5.0           # after a collective timed out, how long the records' read may take (the store's host gone)
PREFIX = "expgpu/watchdog"


class Watchdog:
    """One rank's thread. `where()`: (the run's step, its phase); `before_exit()`: what this rank keeps before it
    ends, for a peer's failure or a hang (its metrics rows written so far, its loggers' runs ended as failed);
    `on_verdict(verdict, line)`: run by the rank that claimed the verdict, before every rank exits."""

    def __init__(self, store, rank: int, world_size: int, run_dir: Path, s: HangSettings,
                 where: Callable[[], tuple[int, str]], on_verdict: Callable[[dict, str], None],
                 before_exit: Callable[[], None] | None = None):
        self.store = store.clone()   # a connection of its own: the loop's collectives keep theirs
        self.rank, self.world, self.run_dir, self.s = rank, world_size, Path(run_dir), s
        self.where, self.on_verdict, self.before_exit = where, on_verdict, before_exit
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
        self._halt()
        try:
            self._step, phase = self.where()   # the step it ended at, not its last tick's: its peers compare theirs
            self._publish(FAILED if failed else phase if ended(phase) else DONE)   # why it ended, kept
        except Exception:   # the store's host (rank 0) may be gone already
            pass
        faulthandler.cancel_dump_traceback_later()
        if self._backstop is not None:
            self._backstop.close()
            path = Path(self._backstop.name)
            if path.exists() and path.stat().st_size == 0:
                path.unlink()

    def _halt(self) -> None:
        """The thread stopped (from another thread: waited for), so that this one may use the store."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def held_up(self, error: BaseException, timeout_s: float) -> str | None:
        """After this rank's collective timed out (expgpu.errors.timed_out): the ranks it waited for and where they
        were, by everyone's records, in words (hang_rules.held_up); None when it cannot tell. Stops this watchdog
        (done() follows)."""
        self._halt()
        try:
            self.store.set_timeout(datetime.timedelta(seconds=READ_S))   # its host, rank 0, may be gone
            records = self._records()
        except Exception:
            return None
        if self.rank not in records:
            return None
        records[self.rank]["step"] = self.where()[0]
        return held_up(records, self.rank, timeout_s, short(f"{type(error).__name__}: {first_line(error)}"))

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
            self._keep()
            _exit(EXIT_PEER_FAILED)
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
        self._keep()   # an MLflow run of a hung run would otherwise stay RUNNING (a restart resumes it)
        self.store.set(f"{PREFIX}/leaving/{self.rank}", "1")
        if self.rank == 0:   # the store's host, where it is expgpu's: the others first, or they lose it mid-call
            self._wait_for([f"{PREFIX}/leaving/{r}" for r in range(1, self.world)], 5)
        _exit()

    def _keep(self) -> None:
        """before_exit(), whatever it raises: what it could not keep is after the last checkpoint (a resume redoes
        it), and this rank must end all the same."""
        if self.before_exit is not None:
            try:
                self.before_exit()
            except Exception:
                pass

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


def start(store, rank: int, world_size: int, run_dir: Path, s: HangSettings | None, where, on_verdict,
          before_exit=None):
    """The rank's watchdog, started; None when it is off. One rank has no process group: its records live
    in a store of this process's own (the same rules: a run of one rank, a sweep's trial, that stops
    making progress holds its GPU for ever, with no collective's timeout to end it)."""
    if s is None:
        return None
    if store is None:
        if world_size > 1:
            return None
        from torch.distributed import HashStore

        store = HashStore()
    return Watchdog(store, rank, world_size, run_dir, s, where, on_verdict, before_exit).start()


# The rules (the limit, the verdict, the culprits, the line) are the script tasks' watch's too: expgpu.procs.hang_rules
__all__ = ["DONE", "EXIT_HUNG", "FAILED", "FLOOR_S", "STEP_FACTOR", "HangSettings", "Watchdog", "culprits", "judge",
           "limit", "line", "settings", "start", "waiting"]
