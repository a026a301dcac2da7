"""How the sweeper runs trials, by launcher: each runner takes one trial's job at a time (submit) and
says which ended (wait), so a new trial starts the moment a slot frees.

- gpu_pool: the pool's Session (its fork server, spares and priming); one trial waits queued ahead,
  primed, and takes the next free slot in the same round as the trial that freed it ended;
- expgpu's slurm / submitit_local: one submitit job per trial, each polled (job.done());
- any other launcher (basic, joblib, submitit without expgpu): Hydra's blocking launch(), a batch
  of n_jobs trials at a time, as Hydra's optuna sweeper does (pruning still works: the jobs report).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from expgpu.procs import stop_signals

log = logging.getLogger("expgpu")


class Runner:
    capacity = 1   # trials at once
    ahead = 0      # trials queued beyond those, so that one is ready when a slot frees

    def check(self, a_trial) -> None:
        """Before the study opens: what a trial's job would refuse at its start, where that comes only after a
        wait in a queue (a UserError). `a_trial()`: the overrides of a trial drawn for the check."""

    def submit(self, overrides: list[str], num: int) -> Path:
        """Start (or queue) job `num`; its job dir."""
        raise NotImplementedError

    def wait(self, timeout_s: float) -> list[tuple[int, object]]:
        """(job number, Hydra's JobReturn) of the jobs that ended, within timeout_s."""
        raise NotImplementedError

    def stopping(self) -> bool:
        """Ctrl-C, SIGTERM or SIGUSR2 reached the sweeper: no new trials; the running ones stop and save."""
        stopper = stop_signals.current()   # a trial run in this process (basic launcher) may be PRUNED: not ours
        return bool(stopper and stopper.received not in (None, stop_signals.PRUNED))

    def busy(self) -> bool:
        """A job submitted and not ended (a queued one that a stop kept from starting has ended)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Ask the running trials to stop and save (the pool does it by itself)."""

    def close(self) -> None:
        pass


class PoolRunner(Runner):
    ahead = 1

    def __init__(self, launcher, n_jobs: int | None):
        from expgpu.pool.session import capacity

        self.launcher = launcher
        self.capacity = n_jobs or capacity(launcher)
        self.session = None
        self.coming = 0

    def expect(self, n: int) -> None:
        self.coming = n
        if self.session is not None:
            self.session.expect(n)

    def submit(self, overrides: list[str], num: int) -> Path:
        if self.session is None:   # opened with the first trial: its config warms the pool's processes
            from expgpu.pool.session import Session

            self.session = Session(self.launcher, [(overrides, num)], max_parallel=self.capacity,
                                   planned=max(self.capacity, self.coming))
            return self.session.pool.jobs[-1].dir
        return self.session.submit(overrides, num).dir

    def wait(self, timeout_s: float) -> list[tuple[int, object]]:
        if self.session is None:
            return []
        return [(job.num, job.ret) for job in self.session.wait(timeout_s)]

    def stopping(self) -> bool:
        return super().stopping() or (self.session is not None and self.session.stop_signal is not None)

    def busy(self) -> bool:
        return self.session is not None and self.session.pool.busy()

    def stop(self) -> None:
        """As on a SIGTERM to the pool: its running trials get it, save and end; queued ones never start."""
        if self.session is not None and self.session.stop_signal is None:
            self.session.pool.stop_signal = signal.SIGTERM

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


class SubmititRunner(Runner):
    """expgpu's slurm and submitit_local launchers: a job per trial, checked as launch() checks a sweep."""

    def __init__(self, launcher, n_jobs: int | None):
        from expgpu.slurm import launch

        self.launcher, self.launch = launcher, launch
        self.plan = launch.plan(launcher)
        launch.check_cluster(self.plan)
        # submitit's own limit on jobs at once (array_parallelism), else what it runs locally
        at_once = int(self.plan.params.get("array_parallelism") or 256)
        self.capacity = n_jobs or (at_once if self.plan.kind == "slurm" else 1)
        self.jobs: dict[int, object] = {}
        self.gone_since: dict[str, float] = {}

    def check(self, a_trial) -> None:
        # every trial has the same task keys (a searched value its function refuses fails that trial alone):
        # one trial's task checked, not a child process per trial
        self.launch.check_tasks([self.launch.compose(self.launcher, self.plan, a_trial(), 0)], "in every trial")

    def submit(self, overrides: list[str], num: int) -> Path:
        from expgpu.pool.job_config import job_dir

        job = self.launch.compose(self.launcher, self.plan, overrides, num)
        self.launch.submit(self.launcher, self.plan, [job])
        self.jobs[num] = job
        return job_dir(job.cfg)

    def wait(self, timeout_s: float) -> list[tuple[int, object]]:
        deadline = time.monotonic() + timeout_s
        while True:
            done = [num for num, job in self.jobs.items() if job.handle.done()]
            if done or time.monotonic() >= deadline or not self.jobs:
                break
            if self.plan.kind == "slurm":
                self.launch.check_lost(list(self.jobs.values()), self.gone_since, self.plan.lost_after_s)
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return [(num, self._return(self.jobs.pop(num))) for num in done]

    def busy(self) -> bool:
        return bool(self.jobs)

    def _return(self, job):
        import submitit

        try:
            return job.handle.results()[0]
        except submitit.core.utils.UncompletedJobError as e:   # killed, cancelled: it ran no run_job to the end
            from hydra.core.utils import JobReturn, JobStatus

            ret = JobReturn(overrides=job.overrides, status=JobStatus.FAILED)
            ret.return_value = RuntimeError(f"job {job.handle.job_id} ended without a result: "
                                            f"{str(e).splitlines()[0]}; its log: {job.handle.paths.stdout}")
            return ret

    def stop(self) -> None:
        """SIGINT to every step of the trials' jobs: expgpu's stop signals save and end them (submitit
        takes SIGUSR2 as a requeue, and ignores SIGTERM)."""
        ids = [job.handle.job_id for job in self.jobs.values() if not job.handle.done()]
        if not ids:
            return
        if self.plan.kind == "slurm":
            subprocess.run(["scancel", "--signal=INT", *ids], capture_output=True, timeout=30)
        else:   # submitit's local jobs: their processes get SIGINT from cancel()
            for job in self.jobs.values():
                job.handle.cancel(check=False)
        log.info("stopping %d trial job(s) (%s): they save, and a rerun of the sweep resumes them", len(ids),
                 " ".join(ids))


class BatchRunner(Runner):
    """Hydra's blocking launch() on batches of `capacity` trials (any other launcher)."""

    def __init__(self, launcher, n_jobs: int | None):
        self.launcher = launcher
        params = getattr(launcher, "params", None) or {}
        joblib = type(launcher).__name__ == "JoblibLauncher"
        n = params.get("n_jobs", -1) if joblib else 1
        self.capacity = n_jobs or (n if n and n > 0 else os.cpu_count() or 1)
        self.pending: list[tuple[list[str], int]] = []

    def busy(self) -> bool:
        return bool(self.pending)

    def submit(self, overrides: list[str], num: int) -> Path:
        self.pending.append((overrides, num))
        sweep = self.launcher.config.hydra.sweep
        return Path(str(sweep.dir)) / str(num)

    def wait(self, timeout_s: float) -> list[tuple[int, object]]:
        out = []
        while self.pending:   # consecutive job numbers in one launch() (Hydra numbers a batch's jobs)
            run = [self.pending.pop(0)]
            while self.pending and self.pending[0][1] == run[-1][1] + 1:
                run.append(self.pending.pop(0))
            returns = self.launcher.launch([o for o, _ in run], initial_job_idx=run[0][1])
            out += [(num, ret) for (_, num), ret in zip(run, returns)]
        return out


def runner_for(launcher, n_jobs: int | None) -> Runner:
    name = type(launcher).__name__
    if name == "GpuPoolLauncher":
        return PoolRunner(launcher, n_jobs)
    if name in ("ExpgpuSlurmLauncher", "ExpgpuLocalLauncher"):
        return SubmititRunner(launcher, n_jobs)
    return BatchRunner(launcher, n_jobs)
