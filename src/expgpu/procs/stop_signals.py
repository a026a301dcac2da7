"""Stop signals, one owner per process: a signal sets a flag that the ranks agree on at a step boundary.

A signal (Ctrl-C, SIGTERM from `kill` or SLURM, SIGUSR2 before a SLURM time limit or preemption) may
reach one rank or all of them, at different moments. Stopping where the signal lands would leave the
ranks at different steps; so the handler only records the request, and the ranks agree on it every
few steps (expgpu.train.agreement) and stop together at the same step, where a checkpoint is
consistent. SIGUSR1 is left alone: NCCL's watchdog and some launchers use it.

One StopSignals per process, installed as early as possible (the CLI entry, a spawned worker's first
line, app.run under a launcher that calls the task function): a signal that arrives while Hydra
composes or torch imports is kept, not lost to the default action (which, for SIGUSR2, kills the
process and with it the chance to requeue). The handlers that were there before are remembered:
under submitit they are its requeue logic, which expgpu.launch.requeue calls once the checkpoint is
on disk.

Besides the signals, two requests come from inside the run, made on rank 0: PRUNED, when an optimizing
sweeper's pruner ends the trial (expgpu.tune.bridge), and DIVERGED, when a logged loss or score becomes nan
or inf under task.on_nonfinite=stop (expgpu.loggers.nonfinite). They are agreed like a signal, so every
rank stops at the same step; both end the run for good (FINAL_REQUESTS: nothing is saved to resume it),
and they are the weakest: a signal that comes with one wins, and its stop saves.

No torch here: every launcher installs it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from expgpu import envvars

# In increasing precedence: when ranks saw different signals they agree on the strongest.
# SIGTERM means SLURM (scontrol requeue, preemption, scancel, the time limit) or a user is
# ending the job and decides what comes next, so it wins over SIGUSR2, which asks expgpu
# to requeue; SIGINT is a person at a terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR2, signal.SIGTERM)
# The stops a run asks for itself (StopSignals.request), no signal: a trial's pruner's, a diverged loss's. The
# weakest requests, and final ones: the run ends for good (its status pruned or diverged; its exit code 0).
PRUNED = "PRUNED"
DIVERGED = "DIVERGED"
FINAL_REQUESTS = (PRUNED, DIVERGED)
REQUESTS = (*FINAL_REQUESTS, *(s.name for s in STOP_SIGNALS))   # by precedence, weakest first
# The signals a worker started by expgpu.launch.spawn stops on: its supervisor's (see StopSignals.install).
ENV_SIGNALS = envvars.STOP_SIGNALS
# A Ctrl-C reaches a worker twice when both its launcher (which passes signals on) and the
# terminal or SLURM (a step's cgroup) signal it: a second SIGINT this soon after the first is
# the same request, not a person pressing Ctrl-C again to abort unsaved.
SAME_CTRL_C_S = 1.0
NEVER = 1 << 62   # a step no run reaches: "no stop requested at a step" (expgpu.train.agreement)


class StopSignals:
    """This process's stop requests: the signals it owns, the strongest request it saw, the one agreed."""

    def __init__(self) -> None:
        self.received: str | None = None   # the strongest request this process saw
        self.agreed: str | None = None     # the request all ranks stopped on (set once they stop)
        self._ctrl_c: float | None = None   # when the first Ctrl-C arrived (time.monotonic)
        self._previous: dict[int, Callable | int | None] = {}
        self.owned: tuple[str, ...] = ()   # the signals that stop this run

    def install(self, only: str | None = None) -> "StopSignals":
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
        # expgpu.launch.spawn starts workers with these signals blocked (block_in_child), so one that
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
        """A stop request (a signal's name, PRUNED or DIVERGED), agreed by the ranks at the next poll."""
        if self.received is None or strength(name) > strength(self.received):
            self.received = name

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process ended by it (130 Ctrl-C, 143 SIGTERM)."""
        name = self.agreed or self.received or "SIGTERM"
        return 0 if name in FINAL_REQUESTS else 128 + int(signal.Signals[name])


def block_in_child() -> None:
    """For a child between fork and exec: hold stop signals until its StopSignals are installed."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def strength(name: str) -> int:
    """A request's precedence: 1 for the weakest (PRUNED), higher for stronger ones."""
    return REQUESTS.index(name) + 1


_current: StopSignals | None = None


def install() -> StopSignals:
    """This process's StopSignals, installed on first use (idempotent)."""
    global _current
    if _current is None:
        _current = StopSignals().install(os.environ.get(ENV_SIGNALS))
    return _current


def current() -> StopSignals | None:
    return _current
