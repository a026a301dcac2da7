"""Which job gets which GPUs or CPU slot, and how many CPU threads each job may use. Pure: no
processes, no locks, no clock (tests drive it with plain lists)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence


class Scheduler:
    """Which waiting jobs start now, given the free GPUs and CPU slots.

    Jobs start in sweep order. A job that needs more GPUs than are free is passed by later jobs
    that fit (no GPU idles while a job could use it), but only `patience` times: after that, GPUs
    that free up are kept for it, so a 2-GPU job is never starved by a stream of 1-GPU jobs, and
    since a job never holds some GPUs while waiting for more, mixed sizes cannot deadlock.
    """

    def __init__(self, patience: int):
        self.patience = max(1, patience)
        self.head: Any = None     # the oldest job that did not fit
        self.passed = 0           # how many jobs started ahead of it

    def pick(self, waiting: Sequence[tuple[Any, int]], free_gpus: Sequence[Any], free_slots: Sequence[int],
             room: float, fit: Callable[[Sequence[Any], Any, int], tuple | None] | None = None,
             ) -> list[tuple[Any, tuple, int | None]]:
        """waiting: (job, GPUs needed; 0 = a CPU slot) in sweep order. Returns (job, its GPUs, its
        CPU slot or None) for every job to start now. fit(free GPUs, job, need): which of the free GPUs
        the job would get, None if it does not fit (inside a SLURM allocation: GPUs of the same node(s));
        by default the first `need` free ones."""
        fit = fit or _first
        gpus, slots = list(free_gpus), list(free_slots)
        starts: list[tuple[Any, tuple, int | None]] = []
        blocked = None
        for job, need in waiting:
            if room <= 0:
                break
            if need == 0:
                if slots:
                    starts.append((job, (), slots.pop(0)))
                    room -= 1
                continue
            if blocked is not None and self.passed >= self.patience:
                continue   # keep what frees up for the blocked job
            taken = fit(gpus, job, need)
            if taken is not None:
                starts.append((job, tuple(taken), None))
                gpus = [g for g in gpus if g not in taken]
                room -= 1
                if blocked is not None:
                    self.passed += 1
            elif blocked is None:
                blocked = job
                if job != self.head:
                    self.head, self.passed = job, 0
        if blocked is None:
            self.head, self.passed = None, 0
        return starts


def _first(free: Sequence[Any], job: Any, need: int) -> tuple | None:
    return tuple(free[:need]) if need <= len(free) else None


def at_once(needs: Sequence[int], n_gpus: int, cpu_slots: int, max_parallel: int | None) -> int:
    """How many of these jobs (GPUs each needs; 0: a CPU slot) can run at the same time, at most."""
    cpu_jobs = sum(1 for n in needs if n == 0)
    gpu_needs = [n for n in needs if n > 0]
    on_gpus = min(len(gpu_needs), n_gpus // min(gpu_needs)) if gpu_needs else 0
    together = min(cpu_jobs, cpu_slots) + on_gpus
    return max(1, int(min(together, max_parallel or math.inf)))


def thread_budget(cores: int, needs: Sequence[int], n_gpus: int, cpu_slots: int,
                  max_parallel: int | None) -> int:
    """CPU threads per job: the cores shared out among the jobs that can run at once (at least 1).

    torch (OpenMP) starts one thread per core in every process: two jobs on two cores would each
    run two threads and slow each other down several times over (issue 11: 6 jobs, 4.4x slower
    than running them one after another)."""
    return max(1, cores // at_once(needs, n_gpus, cpu_slots, max_parallel))
