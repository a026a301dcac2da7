"""Stop requests: a signal sets a flag; the ranks agree at a step boundary.

A signal (Ctrl-C, SIGTERM from `kill` or SLURM, SIGUSR2 before a SLURM time limit
or preemption) may reach one rank or all of them, at different moments. Stopping
where the signal lands would leave the ranks at different steps; so the handler only
records the request, and every few steps the ranks all-reduce it and stop together at
the same step, where a checkpoint is consistent. How many steps: `checkpoint.poll_every`,
by default "auto": as many as take about POLL_TARGET_S, agreed by the ranks at each poll.
SIGUSR1 is left alone: NCCL's watchdog and some launchers use it.

One Stopper per process, installed as early as possible (the CLI entry, a spawned
worker's first line, app.run under a launcher that calls the task function): a signal
that arrives while Hydra composes or torch imports is kept, not lost to the default
action (which, for SIGUSR2, kills the process and with it the chance to requeue).
The handlers that were there before are remembered: under submitit they are its
requeue logic, which expgpu.requeue calls once the checkpoint is on disk.

Besides the signals, one request comes from inside the run: PRUNED, made on rank 0 when an
optimizing sweeper's pruner ends the trial (expgpu.tune.bridge). It is agreed like a signal, so
every rank stops at the same step and saves; it is the weakest: a signal that comes with it wins.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

# In increasing precedence: when ranks saw different signals they agree on the strongest.
# SIGTERM means SLURM (scontrol requeue, preemption, scancel, the time limit) or a user is
# ending the job and decides what comes next, so it wins over SIGUSR2, which asks expgpu
# to requeue; SIGINT is a person at a terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR2, signal.SIGTERM)
# A stop a trial's pruner asks for (Stopper.request): no signal, the weakest request.
PRUNED = "PRUNED"
REQUESTS = (PRUNED, *(s.name for s in STOP_SIGNALS))   # by precedence, weakest first
# The signals a worker started by expgpu.spawn stops on: its supervisor's (see Stopper.install).
ENV_SIGNALS = "EXPGPU_STOP_SIGNALS"
# checkpoint.verify: every rank stops at this step, as on a signal (expgpu/verify.py)
ENV_STOP_AT = "EXPGPU_STOP_AT"
NEVER = 1 << 62
# poll_every="auto": the stop poll's period. A poll is an all-reduce on the ranks' own
# threads; every 10 steps of a fast loop it cost 2-4 % of steps/s on 2 CPU ranks (gloo),
# at ~5 a second nothing measurable. A stop is acted on within 2 periods (0.4 s), far inside
# the 30 s SLURM gives between SIGTERM and SIGKILL. The period is counted in steps timed
# since the last poll, and a new interval takes effect one poll after it is proposed. Until
# steps have been timed the ranks poll after every step (FIRST_INTERVAL): a first step of
# unknown length (data loading, torch.compile, a 4 s step) must not delay a stop by ten of
# them; a fast loop grows to its interval after two or three polls. Should the steps turn
# k times slower at once, the next two polls come up to k times later (then they are back on
# time); checkpoint.poll_every=N fixes the interval instead.
POLL_TARGET_S = 0.2
FIRST_INTERVAL, MAX_INTERVAL = 1, 100_000   # steps: before any step is timed; a sane ceiling
# A Ctrl-C reaches a worker twice when both its launcher (which passes signals on) and the
# terminal or SLURM (a step's cgroup) signal it: a second SIGINT this soon after the first is
# the same request, not a person pressing Ctrl-C again to abort unsaved.
SAME_CTRL_C_S = 1.0


class Stopper:
    def __init__(self) -> None:
        self.poll_every: int | None = None   # steps between polls; None: adaptive (POLL_TARGET_S)
        self.world_size = 1
        self.received: str | None = None   # the strongest signal this process saw
        self.agreed: str | None = None     # the signal all ranks stopped on (set once they stop)
        self._ctrl_c: float | None = None   # when the first Ctrl-C arrived (time.monotonic)
        self._pending = None  # (flags, work) of the stop poll in flight
        self._next = 0        # the step of the next poll
        self._interval = FIRST_INTERVAL
        self.last = NEVER          # the step of the loop's last poll, which reads at once (begin)
        self.stop_at = NEVER       # a stop requested at this step on every rank (checkpoint.verify)
        self._polled = (0, 0.0)   # (step, perf_counter) of the last poll, to time the steps
        self._previous: dict[int, Callable | int | None] = {}
        self.owned: tuple[str, ...] = ()   # the signals that stop this run

    def install(self, only: str | None = None) -> "Stopper":
        """Handle the stop signals; `only` (comma-separated names) limits them to a supervisor's.

        A SIGTERM handler someone installed before expgpu stays: submitit's ignores SIGTERM
        (SLURM sends it before the SIGUSR2 of a preemption, and on an external `scontrol
        requeue`, which reruns the job anyway) and acts on SIGUSR2 alone; stopping on the
        SIGTERM would end the job before SIGUSR2 could requeue it.
        """
        if threading.current_thread() is not threading.main_thread():
            return self  # a launcher running jobs in threads: signals stay with its main thread
        wanted = None if only is None else set(only.split(","))
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if wanted is not None and sig.name not in wanted:
                self._previous[sig] = signal.signal(sig, signal.SIG_IGN)  # as the supervisor's owner does
                continue
            if sig == signal.SIGTERM and callable(current):
                continue
            self._previous[sig] = signal.signal(sig, self._on_signal)
            self.owned += (sig.name,)
        # expgpu.spawn starts workers with these signals blocked (block_in_child), so one that
        # arrives before this point waits, pending, and is delivered to the handler now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def previous_handler(self, sig: int) -> Callable | None:
        """The Python handler someone installed for `sig` before expgpu (submitit's), if any."""
        handler = self._previous.get(sig)
        return handler if callable(handler) and handler is not signal.default_int_handler else None

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._ctrl_c is not None and now - self._ctrl_c > SAME_CTRL_C_S:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now, no checkpoint
            if self._ctrl_c is None:
                self._ctrl_c = now
        self.request(signal.Signals(signum).name)

    def request(self, name: str) -> None:
        """A stop request (a signal's name, or PRUNED), agreed by the ranks at the next poll."""
        if self.received is None or _rank(name) > _rank(self.received):
            self.received = name

    def begin(self, step: int, last: int) -> bool:
        """The poll at the start of training (every rank, before its first step): True if a stop
        was requested while starting up. `last`: the step of the loop's last poll (max_steps - 1),
        which reads at once, so a signal in a run shorter than one poll interval is still acted on."""
        self._pending = None   # of an earlier run in this process, if any: its group is gone
        self.last = last
        if self.world_size == 1:
            return self.should_stop(step)
        strongest, self._interval = self._read(self._reduce(self.poll_every or FIRST_INTERVAL, async_op=False))
        return self._decided(step, strongest)

    def should_stop(self, step: int) -> bool:
        """Called after every step by every rank; True on all ranks at the same step.

        With several ranks the flags are all-reduced every few steps. Fast steps (more than one
        to a poll interval) do not stall on it: the reduction started at one poll is read at the
        next (a request is acted on within two poll intervals, ~0.4 s), so the ranks' compute
        hides its latency. Slow steps (an interval of one step, and every step until steps are
        timed) read it at once: a stop requested during step s lands at the end of step s or,
        had the poll already passed, of s + 1; so does the run's last poll. Every rank polls at
        the same steps and reads alike: a collective that one rank skips would hang the others.
        So an adaptive interval changes only through the reduction: each rank proposes one from
        its own step time, and all take the smallest proposal.
        """
        if self.world_size == 1:
            if step >= self.stop_at:
                self._requested()
            self.agreed = self.received
            return self.received is not None
        if step < self._next:
            return False
        if step >= self.stop_at:   # the poll there reads at once (_decided never schedules past it)
            self._requested()
        strongest = 0
        if self._pending is not None:
            strongest, self._interval = self._read(*self._pending)
            self._pending = None
        if not strongest:
            proposal = self._proposal(step)
            if step >= min(self.last, self.stop_at) or (self.poll_every is None and self._interval == 1):
                strongest, self._interval = self._read(self._reduce(proposal, async_op=False))
            else:
                self._pending = self._reduce(proposal, async_op=True)
        return self._decided(step, strongest)

    def _requested(self) -> None:
        """checkpoint.verify's stop, as if SIGTERM had come (nothing stronger came first)."""
        self.received = self.received or "SIGTERM"

    def _decided(self, step: int, strongest: int) -> bool:
        if strongest:
            self.agreed = REQUESTS[strongest - 1]
            return True
        self._polled = (step, time.perf_counter())
        # never past the last poll: the ranks would train on to the end past a stop request
        self._next = min(step + self._interval, max(min(self.last, self.stop_at), step + 1))
        return False

    def set_last(self, last: int | None) -> None:
        """Under run.epochs, at the last epoch's start (every rank): its last step, where the loader
        has a length; the ranks take the earliest, and none if a rank does not know (a poll that
        one rank skips would hang the others)."""
        if self.world_size > 1:
            import torch
            import torch.distributed as dist

            from expgpu.dist import cpu_group

            flags = torch.tensor([0 if last is not None else 1, -(last or 0)], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group())
            unknown, last = int(flags[0]), -int(flags[1])
            if unknown:
                return
        if last is not None:
            self.last, self._next = last, min(self._next, max(last, 0))

    def _read(self, flags, work=None) -> tuple[int, int]:
        """(the strongest signal, the interval agreed) from a reduction's result."""
        if work is not None:
            work.wait()
        strongest, smallest = (int(v) for v in flags.tolist())
        return strongest, self.poll_every or -smallest

    def _proposal(self, step: int) -> int:
        """The interval this rank asks for: steps worth POLL_TARGET_S at its pace since the last poll."""
        if self.poll_every:
            return self.poll_every
        last_step, last_t = self._polled
        per_step = (time.perf_counter() - last_t) / max(step - last_step, 1)
        return max(1, min(MAX_INTERVAL, int(POLL_TARGET_S / per_step) if per_step > 0 else MAX_INTERVAL))

    def settle(self) -> None:
        """Wait for the poll in flight (every rank started it, so it completes at once); a
        collective left pending when the process group is destroyed aborts the process."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None

    def _reduce(self, proposal: int, async_op: bool):
        """All-reduce (max) [this rank's strongest signal, -its proposed interval] on the CPU
        (expgpu.dist.cpu_group: gloo beside nccl, so a poll never waits for the GPU): the flags
        tensor, with the work in flight when async."""
        import torch
        import torch.distributed as dist

        from expgpu.dist import cpu_group

        mine = _rank(self.received) if self.received else 0
        flags = torch.tensor([mine, -proposal], dtype=torch.int32)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(), async_op=async_op)
        return (flags, work) if async_op else flags

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process ended by it (130 Ctrl-C, 143 SIGTERM)."""
        name = self.agreed or self.received or "SIGTERM"
        return 0 if name == PRUNED else 128 + int(signal.Signals[name])


def block_in_child() -> None:
    """For a child between fork and exec: hold stop signals until its Stopper is installed."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _rank(name: str) -> int:
    return REQUESTS.index(name) + 1


_current: Stopper | None = None


def install() -> Stopper:
    """This process's Stopper, installed on first use (idempotent)."""
    global _current
    if _current is None:
        _current = Stopper().install(os.environ.get(ENV_SIGNALS))
    return _current


def current() -> Stopper | None:
    return _current
