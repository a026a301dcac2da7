"""Starting a sweep's jobs: lease free GPUs, ask the scheduler, hand each job to a warm spare, keep
spares ready for the jobs to come, and say (or give up) when queued jobs wait for other sweeps'
GPUs. The half of expgpu.pool.loop.Pool that starts things; the loop itself ends them."""

from __future__ import annotations

import math
import os
import time
from typing import Any

from expgpu import envvars, procs
from expgpu.errors import one_line
from expgpu.gpus.mask import gpu_env
from expgpu.pool import jobs as jobfiles
from expgpu.pool import sharing
from expgpu.pool.jobs import Job
from expgpu.pool.spares import Spare
from expgpu.procs import oom


class Starter:
    """Mixed into Pool, whose attributes (jobs, gpus, s, spares, board, ...) it uses."""

    def _start_ready(self) -> None:
        from expgpu.pool import leases

        running = self._running()
        room = (self.s.max_parallel or math.inf) - len(running)
        self._busy_elsewhere, self._used_by_others = (), {}
        if room <= 0:
            return
        waiting = [(j.num, j.need) for j in self.jobs if j.state == "queued"]
        held: dict[tuple[int, int], Any] = {}
        if self.gpus and any(need for _, need in waiting):
            ours = {sharing.key(g) for j in running for g in j.gpus}
            candidates = [g for g in self.gpus if sharing.key(g) not in ours]
            held = {sharing.key(lease.gpu): lease for lease in leases.acquire_free(self.lease_dir, candidates)}
            self._busy_elsewhere = tuple(g for g in candidates if sharing.key(g) not in held)
            if self.others is not None:
                self._used_by_others = self._drop_used_by_others(held, running)
        try:
            used = {j.slot for j in running}
            slots = [i for i in range(self.s.cpu_slots) if i not in used]
            by_num = {j.num: j for j in self.jobs}
            fit = sharing.distinct if self.s.jobs_per_gpu > 1 else None   # a job's shares on as many GPUs
            for num, keys, slot in self.scheduler.pick(waiting, list(held), slots, room, fit):
                self._start(by_num[num], [held.pop(k) for k in keys], slot)
        finally:
            leases.release_all(list(held.values()))

    def _drop_used_by_others(self, held: dict, running: list[Job]) -> dict:
        """Let go of the leased GPUs that a process outside expgpu computes on (expgpu.pool.busy): those that no
        expgpu job holds, of this sweep or another, and NVML sees busy all the same. GPU index -> (the GPU,
        its processes), for _check_waiting."""
        from expgpu.pool import busy, leases

        ours = {g.index for j in running for g in j.gpus}   # our own jobs compute on these
        by_card: dict[int, list] = {}
        for k in held:
            by_card.setdefault(k[0], []).append(k)
        used = {}
        for index, keys in by_card.items():
            gpu = held[keys[0]].gpu
            if index in ours or leases.shared_elsewhere(self.lease_dir, gpu, [k[1] for k in keys]):
                continue
            procs = self.others.on(gpu)
            if not procs:
                self._said_busy.discard(index)
                continue
            used[index] = (gpu, procs)
            leases.release_all([held.pop(k) for k in keys])
            if index not in self._said_busy:   # once, until it frees
                self._said_busy.add(index)
                self.board.event(f"{busy.describe(gpu, procs)}: no job of this sweep starts on it until it frees "
                                 "(hydra.launcher.busy_gpus=use: start them all the same)")
        return used

    def _new_spare(self) -> Spare:
        if self.server.alive():
            return Spare(self.sweep_dir / jobfiles.STATE, hide_gpus=bool(self.gpus), server=self.server)
        # Without the fork server (it refused to fork, or died): a process that warms up itself; the
        # context (the task function) only where the task's own modules may be imported ahead
        # (spares.task_modules): unpickling it may import them.
        return Spare(self.sweep_dir / jobfiles.STATE, hide_gpus=bool(self.gpus), warm=self.warm,
                     context=self.context if self.own_code else None)

    def _keep_spares(self) -> None:
        """Warm processes for the jobs to come: as many as could start at once, one warming at a time
        (so they do not slow the running jobs' own start-up)."""
        for spare in [sp for sp in self.spares if not sp.alive()]:
            self.spares.remove(spare)
            spare.dismiss()
            self._spares_broken = True
            self.warm = []   # perhaps a task module that spares cannot import ahead (CUDA at import)
        queued = [j for j in self.jobs if j.state == "queued"] if self.stop_signal is None else []
        coming = len(queued) + (self.expected if self.stop_signal is None else 0)
        want = 0 if self._spares_broken else min(coming, self.capacity)
        self.spares.sort(key=lambda sp: sp.job is None)   # the last ones go first: unprimed ones
        while len(self.spares) > want:
            self.spares.pop().dismiss()
        if len(self.spares) < want and all(sp.is_ready() for sp in self.spares):
            self.spares.append(self._new_spare())
        if self.prime:
            self._prime(queued)

    def _prime(self, queued: list[Job]) -> None:
        """Each ready spare takes one of the next queued jobs (sweep order: the order they start in)
        and does Hydra's set-up of it while the slots are still busy (Spare.prime). At once, even beside
        a job that has just started its own set-up: trials that end every few tenths of a second (a
        pruner's) would otherwise start unprimed, ~0.02 s more of each one's slot, and priming at once did
        not slow a grid of CPU-bound jobs on 2 cores (12 on 2 slots: the same makespan)."""
        primed = {sp.job.num for sp in self.spares if sp.job is not None}
        todo = iter(j for j in queued if j.num not in primed)
        for spare in self.spares:
            if spare.job is not None or not spare.is_ready():
                continue
            job = next(todo, None)
            if job is None:
                return
            try:
                spare.prime(job, {"job_file": str(jobfiles.write_job_file(job, self.context)),
                                  "console": str(job.dir / jobfiles.CONSOLE)})
            except OSError:   # it died: _keep_spares replaces it; its job starts as if not primed
                pass

    def _process(self, job: Job) -> Spare:
        """A process for `job`: the spare primed with it, else a warmed-up one primed with none."""
        alive = [sp for sp in self.spares if sp.alive() and sp.job in (None, job)]
        pick = next((sp for sp in alive if sp.job is job), None) or next(
            (sp for sp in alive if sp.is_ready() and sp.job is None), None) or next(
            (sp for sp in alive if sp.job is None), None)
        if pick is not None:
            self.spares.remove(pick)
            return pick
        return self._new_spare()

    def _job_env(self, job: Job, gpus: list, slot: int | None) -> dict[str, str]:
        env = {**self.job_env, envvars.POOL_JOB: str(job.num),
               envvars.POOL_GPUS: ",".join(str(g.index) for g in gpus)}
        if slot is not None:
            env[envvars.POOL_SLOT] = str(slot)
        if self.gpus:  # a machine with GPUs: a job sees its own and no other (none for a CPU job)
            env.update(gpu_env(gpus, os.environ.get("CUDA_DEVICE_ORDER")))
        return env

    def _start(self, job: Job, job_leases: list, slot: int | None) -> None:
        from expgpu.pool import leases

        gpus = [lease.gpu for lease in job_leases]
        spare = None
        try:
            spare = self._process(job)
            try:
                pid = spare.proc.pid   # a fork's: once the server has made it
            except OSError:   # the fork server is gone (it refused to fork): a process of its own
                spare.dismiss()
                spare = self._new_spare()
                pid = spare.proc.pid
            for lease in job_leases:
                lease.note(pid=pid, sweep=str(self.sweep_dir), job=job.num)
            spec = {"env": self._job_env(job, gpus, slot), "threads": self.threads}
            job.primed = spare.job is job
            if not job.primed:
                spec.update(job_file=str(jobfiles.write_job_file(job, self.context)),
                            console=str(job.dir / jobfiles.CONSOLE))
            spare.give(spec, [fd for lease in job_leases for fd in lease.fds])
            job.exit_fd = procs.exit_fd(pid)
        except OSError as e:
            leases.release_all(job_leases)
            job.state = "failed"
            job.error = f"could not start: {one_line(e)}" + (jobfiles.last_line(spare.log) if spare else "")
            if spare is not None:
                spare.dismiss()
            job.ret = self._job_return(job, None)
            self.board.event(f"#{job.num} failed to start: {job.error}")
            self._dirty = True
            return
        job.proc = spare.proc
        job.oom_count = oom.OomCount(job.proc.pid)
        for lease in job_leases:  # the job's process holds the lease from now on
            lease.handed_over()
        job.state, job.gpus, job.slot, job.started = "running", gpus, slot, time.time()
        self._waiting_since = None
        self.board.event(f"#{job.num} started on {job.where}: {job.label}")
        self._dirty = True

    def _check_waiting(self) -> None:
        """Say who holds the GPUs queued jobs wait for; give up after wait_timeout_s."""
        from expgpu.pool import busy, leases

        queued = [j for j in self.jobs if j.state == "queued" and j.need > 0]
        # The lock said busy a moment ago; the file says by whom (read, not locked: no churn).
        # A job of ours that just ended may hold its lease a moment longer: that is no news.
        holders = [(g, leases.noted(self.lease_dir, g)) for g in self._busy_elsewhere]
        holders = [(g, h) for g, h in holders if h.get("sweep") != str(self.sweep_dir)]
        if not queued or not (holders or self._used_by_others):
            self.board.waiting("")
            self._waiting_since = None
            return
        who = "; ".join(([f"{sharing.shown([g])}: {leases.describe_holder(h or {'pid': '?'})}" for g, h in holders]
                         + [busy.describe(g, procs) for g, procs in self._used_by_others.values()])[:4])
        by = " or ".join(([] if not holders else ["leased by others"])
                         + ([] if not self._used_by_others else ["in use outside expgpu"]))
        self.board.waiting(f"waiting for GPUs {by} ({who})")
        if self._running() or self.s.wait_timeout_s is None:
            self._waiting_since = None
            return
        now = time.monotonic()
        self._waiting_since = self._waiting_since or now
        if now - self._waiting_since > self.s.wait_timeout_s:
            for job in queued:
                job.state = "failed"
                job.error = (f"no GPU within hydra.launcher.wait_timeout_s={self.s.wait_timeout_s:g}s; "
                             f"{by}: {who}")
                job.ret = self._job_return(job, None)
            self.board.event(f"gave up on {len(queued)} queued job(s) after {self.s.wait_timeout_s:g}s")
            self._dirty = True
