"""The ranks agree on a stop at a step boundary: every few steps they all-reduce the strongest request
each saw (expgpu.procs.signals) and stop together, at the same step, where a checkpoint is consistent.

How many steps between polls: `checkpoint.poll_every`, by default "auto": as many as take about
POLL_TARGET_S, agreed by the ranks at each poll.
"""

from __future__ import annotations

import time

from expgpu.procs.stop_signals import NEVER, REQUESTS, StopSignals, strength

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


class StopAgreement:
    """One rank's side of the stop polls of a run: `signals` is this process's StopSignals; `stop_at`,
    a step where every rank stops as on SIGTERM (checkpoint.verify)."""

    def __init__(self, signals: StopSignals, world_size: int = 1, poll_every: int | None = None,
                 stop_at: int = NEVER) -> None:
        self.signals = signals
        self.world_size = world_size
        self.poll_every = poll_every   # steps between polls; None: adaptive (POLL_TARGET_S)
        self.stop_at = stop_at
        self._pending = None  # (flags, work) of the stop poll in flight
        self._next = 0        # the step of the next poll
        self._interval = FIRST_INTERVAL
        self.last = NEVER          # the step of the loop's last poll, which reads at once (begin)
        self._polled = (0, 0.0)   # (step, perf_counter) of the last poll, to time the steps

    @property
    def agreed(self) -> str | None:
        """The request all ranks stopped on, once they stopped."""
        return self.signals.agreed

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
            self.signals.agreed = self.signals.received
            return self.signals.received is not None
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
        self.signals.received = self.signals.received or "SIGTERM"

    def _decided(self, step: int, strongest: int) -> bool:
        if strongest:
            self.signals.agreed = REQUESTS[strongest - 1]
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

            from expgpu.distributed.group import cpu_group

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
        (expgpu.distributed.group.cpu_group: gloo beside nccl, so a poll never waits for the GPU): the flags
        tensor, with the work in flight when async."""
        import torch
        import torch.distributed as dist

        from expgpu.distributed.group import cpu_group

        mine = strength(self.signals.received) if self.signals.received else 0
        flags = torch.tensor([mine, -proposal], dtype=torch.int32)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(), async_op=async_op)
        return (flags, work) if async_op else flags
