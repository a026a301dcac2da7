"""The gpu_pool for a sweeper that adds jobs one at a time and waits for any to end (expgpu.tune):
the same Pool, fork server, spares and priming as Hydra's blocking launch(), driven a round at a
time instead of until the last job of a batch is done.

    session = Session(launcher, first=[(overrides, num), ...], max_parallel=n_jobs)
    session.submit(overrides, num)        # queued; it starts the moment a GPU or slot is free
    ended = session.wait(timeout_s)       # the jobs that ended (job.ret: Hydra's JobReturn)
    session.close()
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

from expgpu.pool.jobs import Job
from expgpu.pool.kept import keep_finished
from expgpu.pool.launch import close_pool, compose_job, open_pool
from expgpu.pool.loop import POLL_S

log = logging.getLogger("expgpu.pool")


class Session:
    def __init__(self, launcher, first: list[tuple[list[str], int]], max_parallel: int | None = None,
                 planned: int = 0):
        """`launcher`: the GpuPoolLauncher Hydra set up (its params, context, task function, config);
        `planned`: about how many jobs will come in all."""
        self.launcher = launcher
        self.pool = open_pool(launcher.params, launcher.hydra_context, launcher.task_function, launcher.config,
                              first, max_parallel, planned)
        # jobs kept from an earlier run of the sweep dir (expgpu.pool.kept): the next wait() returns them
        self._kept = [j for j in self.pool.jobs if j.kept]
        try:
            self.pool.begin()
        except BaseException:
            close_pool(self.pool)
            raise

    @property
    def stop_signal(self) -> int | None:
        """The Ctrl-C / SIGTERM the pool received (its running jobs are stopping), else None."""
        return self.pool.stop_signal

    def expect(self, n: int) -> None:
        """About n more jobs will come: warm processes are kept ready for them (not past capacity)."""
        self.pool.expected = max(0, n)

    def submit(self, overrides: Sequence[str], num: int) -> Job:
        p = self.pool
        job = compose_job(self.launcher.hydra_context, self.launcher.config, overrides, num, p.s, p.gpus, p.alloc)
        p.jobs.append(job)   # the board and pool.json show the same list
        p._dirty = True
        if keep_finished([job]):
            p.board.event(f"#{job.num} finished in an earlier run of this sweep dir: kept, not started again")
            self._kept.append(job)
        return job

    def running(self) -> list[Job]:
        return [j for j in self.pool.jobs if j.state in ("queued", "running")]

    def wait(self, timeout_s: float) -> list[Job]:
        """Rounds of the pool until a job ends (started ones first: a queued job takes a freed slot in
        the same round) or `timeout_s` passes; the jobs that ended, their JobReturn read."""
        deadline = time.monotonic() + timeout_s
        while True:
            ended, self._kept = self.pool.round() + self._kept, []
            left = deadline - time.monotonic()
            if ended or not self.pool.busy() or left <= 0:
                return ended
            self.pool.board.tick()
            self.pool._idle(min(POLL_S, left))

    def close(self) -> None:
        try:
            self.pool.end()
        finally:
            close_pool(self.pool)
        self.pool.summary(log)


def capacity(launcher) -> int:
    """How many jobs like the sweep's own config the gpu_pool `launcher` runs at once, before anything
    starts: its GPUs over the GPUs a job needs, or its CPU slots; narrowed by max_parallel."""
    from omegaconf import OmegaConf

    from expgpu.pool import allocation
    from expgpu.pool.scheduler import at_once
    from expgpu.pool.settings import job_need, job_nodes, need_in_allocation, pool_gpus, settings

    s = settings(launcher.params)
    alloc = allocation.detect(os.environ)
    if alloc is not None:   # inside a SLURM allocation: its GPUs (or CPU slots), a job's on each of its nodes
        if allocation.cpu_jobs(alloc, s):
            alloc = allocation.on_cpu_slots(alloc, s.cpu_slots)
        shares = len(alloc.slots()) * (1 if alloc.cpu else s.jobs_per_gpu)
        need = need_in_allocation(launcher.config, s, alloc, job_nodes(launcher.config, s)[0])
        return at_once([need] * (shares + 1), shares, s.cpu_slots, s.max_parallel)
    simulate = OmegaConf.select(launcher.config, "inventory.simulate", default=None)
    if OmegaConf.is_config(simulate):
        simulate = OmegaConf.to_container(simulate, resolve=True)
    gpus = pool_gpus(s, simulate)
    need = job_need(launcher.config, s, len(gpus))
    shares = len(gpus) * s.jobs_per_gpu   # hydra.launcher.jobs_per_gpu: each GPU that many times
    many = shares + s.cpu_slots   # more jobs than could ever run at once
    return at_once([need] * many, shares, s.cpu_slots, s.max_parallel)
