"""Stop requests: a signal sets a flag; the ranks agree at a step boundary.

A signal (Ctrl-C, SIGTERM from `kill` or SLURM, SIGUSR2 before a SLURM time limit
or preemption) may reach one rank or all of them, at different moments. Stopping
where the signal lands would leave the ranks at different steps; so the handler only
records the request, and every `poll_every` steps the ranks all-reduce the flag and
stop together at the same step, where a checkpoint is consistent.
SIGUSR1 is left alone: NCCL's watchdog and some launchers use it.
"""

from __future__ import annotations

import signal
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


class Stopper:
    def __init__(self, poll_every: int = 10, world_size: int = 1):
        self.poll_every = poll_every
        self.world_size = world_size
        self.received: str | None = None  # name of the first signal seen
        self._previous: dict[int, Callable | int | None] = {}

    def install(self) -> "Stopper":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, no checkpoint
        self.received = self.received or signal.Signals(signum).name

    def should_stop(self, step: int) -> bool:
        """Called after every step; collective every poll_every steps when world_size > 1."""
        if self.world_size == 1:
            return self.received is not None
        if step % self.poll_every:
            return False
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop and self.received is None:
            self.received = "peer"
        return stop
