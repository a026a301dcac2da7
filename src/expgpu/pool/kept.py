"""Jobs a rerun of a sweep dir does not start again: their job dir already holds their task's finished run.

A requeued slurm_pool allocation runs the same sweep again in the same sweep dir (as does a user's rerun
with hydra.sweep.dir=...). expgpu's app would keep such a job's result.json itself (results.finished_earlier)
after its process had started; the pool checks the same thing first, so a finished job costs no process,
no srun step and no GPU: its JobReturn is made here from its result.json, as its task function would have
returned it. Cut jobs (a checkpoint, no finished result) run again and resume from their checkpoints.
Only expgpu's own tasks: another Hydra app's job leaves nothing the pool could read.
"""

from __future__ import annotations

import copy

from expgpu.pool.jobs import Job


def finished_return(job: Job):
    """The JobReturn of `job`'s finished run in its job dir (same task settings), or None."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf, open_dict

    from expgpu import config as expgpu_config
    from expgpu.pool.job_config import resolved
    from expgpu.results import finished_earlier

    if not expgpu_config.is_expgpu(job.config) or not (job.dir / "result.json").exists():
        return None
    try:
        plain = {k: resolved(job.config, k) for k in ("task", "checkpoint")}   # ${hydra:...} as in the job
        if not plain["task"].get("name"):   # as app.run names it before it writes result.json
            plain["task"]["name"] = job.config.hydra.runtime.choices.get("task") or "task"
        result = finished_earlier(job.dir, plain)
        if result is None:
            return None
        ret = JobReturn(overrides=list(job.overrides), working_dir=str(job.dir), status=JobStatus.COMPLETED,
                        task_name=str(job.config.hydra.job.name))
        ret.cfg = copy.deepcopy(job.config)
        with open_dict(ret.cfg):
            del ret.cfg["hydra"]
        ret.hydra_cfg = OmegaConf.create({"hydra": job.config.hydra})
        ret.return_value = expgpu_config.objective(ret.cfg, result)
        return ret
    except Exception:   # anything the pool cannot judge: the job runs, and app.run decides
        return None


def keep_finished(jobs: list[Job]) -> list[Job]:
    """Mark the jobs whose finished run is in their job dir as finished (their `ret` set); those jobs."""
    kept = []
    for job in jobs:
        ret = finished_return(job)
        if ret is not None:
            job.ret, job.state, job.kept = ret, "finished", True
            kept.append(job)
    return kept

