"""faults.*: what tests and bench/ set to make a rank crash, or compute slower, on purpose
(their config: expgpu.schema's FaultsConfig; their checks: expgpu.config.check)."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from expgpu.results import current_attempt

log = logging.getLogger("expgpu")


def crash(faults: dict, rank: int, step: int) -> None:
    """At faults.crash_step: rank faults.crash_rank raises, or with faults.kind=kill dies outright, or with
    faults.kind=hang stops making progress for good; with faults.crash_attempts=N only in the run's first N
    attempts (launch.max_restarts starts it again: a fault that goes away, as most do), else in every one."""
    attempts = faults.get("crash_attempts")
    if attempts is not None and current_attempt() > attempts:
        return
    if faults.get("crash_rank") == rank:
        if faults.get("kind") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if faults.get("kind") == "hang":
            hang_forever(rank, step)
        raise RuntimeError(f"injected crash (faults.crash_rank={rank} faults.crash_step={step})")


def hang_forever(rank: int, step: int) -> None:
    """faults.kind=hang: no progress for good, as a stuck read does (the watchdog's line names this function)."""
    log.warning("rank %d: injected hang at step %d (faults.kind=hang)", rank, step)
    while True:
        time.sleep(3600)


@dataclass
class Slowness:
    """Test and bench/ knobs that stand in for slower devices on a CPU machine.

    faults.slow_rank / faults.slow_factor: that rank sleeps (factor - 1) x the CPU time its
    forward and backward took, so the extra time shrinks with its batch as a slower device's
    would. faults.device_ms_per_example: every rank also sleeps this long per example of its
    batch (x slow_factor on the slow rank), a device that computes while the CPU waits, as a
    GPU does; it makes a bench on a small, shared CPU box measure the balancing rather than the
    neighbours' load. Sleeping keeps the other ranks' cores free."""
    factor: float = 1.0
    ms_per_example: float = 0.0

    def start(self) -> float:
        return time.process_time()

    def finish(self, started: float, batch: int) -> None:
        cpu = time.process_time() - started
        time.sleep((self.factor - 1.0) * cpu + self.factor * self.ms_per_example * batch / 1000.0)


def slowness_of(faults: dict, rank: int) -> Slowness | None:
    """This rank's Slowness, or None when faults.* slow nothing down here."""
    factor = float(faults.get("slow_factor") or 1.0) if faults.get("slow_rank") == rank else 1.0
    ms = float(faults.get("device_ms_per_example") or 0.0)
    return Slowness(factor, ms) if factor > 1.0 or ms > 0 else None
