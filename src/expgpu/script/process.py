"""A rank's script in a process of its own: started, its output passed on, stops handed down, waited for.

- Output: stdout and stderr go to this process's console, as the script would have printed them, and
  both (in the order they came) to RUN_DIR/logs/rank<N>.script.log; the last lines of stderr are kept
  for the error that names a failed rank.
- Stops: a stop signal this process receives (expgpu.procs.stop_signals: Ctrl-C, SIGTERM, SIGUSR2; from a
  terminal, SLURM, expgpu's spawn or the pool) is passed to the script once, as the same signal; the
  script has grace_s to exit, then its whole process group gets SIGKILL. A second Ctrl-C more than a
  second later (KeyboardInterrupt here) kills it at once.
- Hangs: a `watch` (expgpu.script.watch) is shown the script's pid and when it last wrote output at every
  tick; when it says the script hung (its stacks taken), the script is stopped as on SIGTERM: grace_s,
  then SIGKILL for its whole process group.
- No orphans: the script dies with this process (PR_SET_PDEATHSIG), runs in a session of its own (a
  terminal's Ctrl-C reaches it only through here, once), and what it leaves running when it exits
  (a DataLoader worker, a stray child) is killed with its group.
"""

from __future__ import annotations

import collections
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from expgpu import procs
from expgpu.errors import collective_error
from expgpu.procs import stop_signals

TICK_S = 0.1        # how often a stop, the grace deadline and the on_tick callback are looked at
# Under submitit a preemption is SIGTERM to every process of the job's steps, then SIGUSR2, its requeue signal
# (submitit's SlurmJob._interrupt sends them one after the other): how long a script that died of the first
# waits for the second
PREEMPT_WAIT_S = 5.0
DRAIN_S = 2.0       # after the script exits, how long a child it left may hold its pipes open
TAIL_LINES = 20
PARTIAL_S = 0.2     # how long the start of a line waits for its end before the console gets it as it is


@dataclass
class Outcome:
    returncode: int | None            # Popen's: -N for a signal; None: never started
    stopped_by: str | None = None     # the stop signal passed to the script (or that kept it from starting)
    killed: bool = False              # SIGKILLed after the grace period
    hung: bool = False                # stopped because its watch found it hung
    tail: list[str] = field(default_factory=list)   # the last lines of its stderr
    collective: str | None = None     # the first stderr line in which torch.distributed said a collective failed
    started: float = 0.0
    ended: float = 0.0

    @property
    def exit_code(self) -> int | None:
        """As a shell reports it: 128 + N for a death by signal N."""
        rc = self.returncode
        return None if rc is None else (128 - rc if rc < 0 else rc)



_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


def _setup_child() -> None:
    procs.die_with_parent()
    # The script's stop signals act as from a shell: an ignored one (a worker ignores the signals its
    # launcher does not stop on) or a blocked one would pass through exec.
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)


def run_script(argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, stopper, grace_s: float,
        on_tick: Callable[[], None] | None = None, watch=None, console_stdout: bool = True) -> Outcome:
    """Start the script and supervise it to its end; a stop requested before it starts keeps it from starting.
    `watch.tick(pid, output_at)` (output_at: time.monotonic() of its last output) -> True: it hung.
    `console_stdout=False`: its stdout goes to the log only (launch.stdout=rank0, on the other ranks)."""
    if stopper.received:
        now = time.time()
        return Outcome(None, stopped_by=stopper.received, started=now, ended=now)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"--- expgpu: {' '.join(argv)} (in {cwd}, {time.strftime('%Y-%m-%d %H:%M:%S')})\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=_setup_child, start_new_session=True)
        outcome = Outcome(None, started=time.time())
        try:
            _supervise(proc, _Tee(proc, log, console_stdout), outcome, stopper, grace_s, on_tick, watch)
        finally:
            procs.kill_group(proc.pid)   # whatever it left behind, or all of it on a second Ctrl-C
            proc.wait()
            outcome.returncode, outcome.ended = proc.returncode, time.time()
    if outcome.stopped_by is None and not outcome.hung and -outcome.returncode in _STOPS:
        # a stop signal sent to the script itself (SLURM signals every process of a step; under submitit,
        # whose SIGTERM this process leaves alone, the script still gets one): a stop, not a crash
        outcome.stopped_by = signal.Signals(-outcome.returncode).name
    return outcome


def await_requeue(outcome: Outcome, stopper) -> None:
    """A script that died of a SIGTERM sent to it directly, where this process leaves SIGTERM to another
    owner whose SIGUSR2 requeues the job (submitit's handlers): that was a preemption's first signal, so wait
    PREEMPT_WAIT_S for its SIGUSR2; when it comes the stop is SIGUSR2 (the job is requeued and the script
    resumes, as a script that handles SIGTERM would be), else it stays a SIGTERM stop (scancel)."""
    if outcome.stopped_by != "SIGTERM" or stopper.received not in (None, "SIGUSR2") or "SIGTERM" in stopper.owned \
            or stopper.previous_handler(signal.SIGUSR2) is None:
        return   # (the SIGUSR2 may have come already, as the script was dying)
    deadline = time.monotonic() + PREEMPT_WAIT_S
    while stopper.received is None and time.monotonic() < deadline:
        time.sleep(TICK_S)
    if stopper.received == "SIGUSR2":
        outcome.stopped_by = "SIGUSR2"


def _supervise(proc, tee: _Tee, outcome: Outcome, stopper, grace_s: float, on_tick, watch) -> None:
    deadline = None
    exited_at = None
    while True:
        tee.pump(TICK_S)
        if stopper.received and outcome.stopped_by is None and not outcome.hung and proc.poll() is None:
            outcome.stopped_by = stopper.received
            # a pruner's stop reaches the script as any stop does (it may save; the trial is final anyway)
            proc.send_signal(signal.SIGTERM if stopper.received == stop_signals.PRUNED
                             else signal.Signals[stopper.received])
            deadline = time.monotonic() + grace_s
        if watch is not None and deadline is None and proc.poll() is None and watch.tick(proc.pid, tee.output_at):
            outcome.hung = True
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline and proc.poll() is None:
            procs.kill_group(proc.pid)
            outcome.killed = True
        if on_tick is not None:
            on_tick()
        if proc.poll() is not None:
            exited_at = exited_at or time.monotonic()
            if tee.closed or time.monotonic() - exited_at > DRAIN_S:
                tee.pump(0)
                tee.flush()
                outcome.tail, outcome.collective = tee.tail(), tee.collective
                return


class _Tee:
    """The script's stdout and stderr to this process's (its stdout not, under launch.stdout=rank0 on the
    other ranks), and both to the log file."""

    def __init__(self, proc, log, console_stdout: bool = True):
        self.log = log
        self.sel = selectors.DefaultSelector()
        self.partial = b""
        self.lines: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        # NCCL's watchdog says a collective timed out, then aborts the process with pages of C++ frames, which
        # push its words out of the tail: its first such line, kept (expgpu.script.result)
        self.collective: str | None = None
        self.output_at = time.monotonic()   # when the script last wrote to either pipe (or started)
        # The console gets whole lines: the script writes unbuffered (script.environ: print()'s text and its
        # newline apart), and the ranks share the console, so a line relayed in pieces would be cut by another
        # rank's. A line's start waits for its end (or a \r: a progress bar), or PARTIAL_S of silence (a prompt).
        self.held: dict[int, tuple[object, bytes, float]] = {}   # fd -> (console, bytes not relayed, since)
        for pipe, console in ((proc.stdout, sys.stdout if console_stdout else None), (proc.stderr, sys.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.sel.register(pipe, selectors.EVENT_READ, (console, pipe is proc.stderr))

    @property
    def closed(self) -> bool:
        return not self.sel.get_map()

    def pump(self, timeout: float) -> None:
        if self.closed:
            time.sleep(timeout)
            return
        for key, _ in self.sel.select(timeout):
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            console, is_err = key.data
            if not data:
                self._relay(key.fd, console, b"", end=True)
                self.sel.unregister(key.fileobj)
                key.fileobj.close()
                continue
            self.output_at = time.monotonic()
            self._relay(key.fd, console, data)
            self.log.write(data)
            self.log.flush()
            if is_err:
                *done, self.partial = (self.partial + data).split(b"\n")
                self.lines.extend(done)
                if self.collective is None:
                    self.collective = next((text for text in map(_decoded, done) if collective_error(text)), None)
        self.flush(PARTIAL_S)

    def flush(self, held_s: float = 0.0) -> None:
        """To the console, the start of a line held for `held_s` or more."""
        for fd, (console, held, since) in list(self.held.items()):
            if held and time.monotonic() - since >= held_s:
                self._relay(fd, console, b"", end=True)

    def _relay(self, fd: int, console, data: bytes, end: bool = False) -> None:
        """To the console, up to the last line end in what this pipe gave (all of it at `end`)."""
        if console is None:
            return
        _, held, since = self.held.get(fd, (console, b"", 0.0))
        text = held + data
        cut = len(text) if end else max(text.rfind(b"\n"), text.rfind(b"\r")) + 1
        if cut:
            _echo(console, text[:cut])
        self.held[fd] = (console, text[cut:], since if held and not cut else time.monotonic())

    def tail(self) -> list[str]:
        lines = [*self.lines, self.partial] if self.partial else list(self.lines)
        return [_decoded(line) for line in lines]


def _decoded(line: bytes) -> str:
    return line.decode(errors="replace")


def _echo(console, data: bytes) -> None:
    try:
        console.flush()
        buffer = getattr(console, "buffer", None)
        if buffer is not None:
            buffer.write(data)
            buffer.flush()
        else:
            console.write(data.decode(errors="replace"))
            console.flush()
    except (OSError, ValueError):   # a closed console must not end the supervision
        pass
