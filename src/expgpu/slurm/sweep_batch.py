"""`hydra/launcher=slurm_pool` called in-process (Hydra's compose API, a test runner, a notebook): no command
line to run again inside the allocation (expgpu.slurm.sweep_job), so each launch() sends its jobs themselves,
as hydra-submitit-launcher sends a job: the task function, Hydra's context and singletons, the sweep's config
and the jobs' overrides, cloudpickled into SWEEP_DIR/.slurm_pool/batch-<first job>/. One allocation runs them
with gpu_pool (`python -m expgpu.slurm.sweep_batch DIR`) and sends their JobReturns back the same way, and
launch() returns those, as Hydra's launchers do. The queue is paid per launch(): an optimizing sweeper that
asks for a batch at a time pays it per batch (from a command line, the whole study is one allocation).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from expgpu.errors import UserError
from expgpu.rundir import atomic_write_bytes
from expgpu.slurm import follow, sweep_job

JOBS = "jobs.pkl"         # what the allocation runs
RETURNS = "returns.pkl"   # their JobReturns, written by the allocation as its last act


def launch(params: Mapping[str, Any], config, hydra_context, task_function, job_overrides: Sequence[Sequence[str]],
           initial_job_idx: int) -> list:
    """Run `job_overrides` as jobs initial_job_idx.. in one SLURM allocation; their JobReturns."""
    import cloudpickle
    from hydra.core.singleton import Singleton

    params = sweep_job.plain(params)
    sweep_job.check(params)
    if params.get("detach"):
        raise UserError("hydra.launcher.detach=true is not allowed here: this sweep was not started by its command "
                        "line, so each launch() waits for its jobs' results (false), to hand them to the sweeper")
    # each job fits the allocation, or one line
    sweep_job.planned(params, config, hydra_context, job_overrides, initial_job_idx)
    if not job_overrides:
        return []
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    state = sweep_dir / sweep_job.STATE / f"batch-{initial_job_idx}"
    state.mkdir(parents=True, exist_ok=True)
    (state / RETURNS).unlink(missing_ok=True)   # an earlier run's
    atomic_write_bytes(state / JOBS, cloudpickle.dumps({
        "singletons": Singleton.get_state(), "hydra_context": hydra_context, "task_function": task_function,
        "config": config, "overrides": [list(o) for o in job_overrides], "first": initial_job_idx,
        "pool": sweep_job.inside(params)}))
    record = sweep_job.submit_command(params, [sys.executable, "-m", "expgpu.slurm.sweep_batch", str(state)],
                                      sweep_dir, state)
    last = initial_job_idx + len(job_overrides) - 1
    print(f"slurm_pool: jobs #{initial_job_idx}..#{last} are SLURM job {record['job_id']} "
          f"({sweep_job.shape(params)}); its output: {record['output']}", flush=True)
    code = follow.follow(record)
    if follow.state_of(record["job_id"]) is not None:   # followed no more (Ctrl-C): the job runs on
        raise KeyboardInterrupt
    try:
        return cloudpickle.loads((state / RETURNS).read_bytes())
    except OSError:
        why = (f"slurm_pool: SLURM job {record['job_id']} ended (exit code {code}) without its jobs' results "
               f"(cancelled, its time limit, a node lost?); its output: {record['output']}")
        return [_failed(o, why) for o in job_overrides]


def _failed(overrides: Sequence[str], why: str):
    from hydra.core.utils import JobReturn, JobStatus

    ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
    ret.return_value = RuntimeError(why)
    return ret


def main(argv: list[str] | None = None) -> None:
    """Inside the allocation: the jobs of DIR/jobs.pkl on gpu_pool, their JobReturns to DIR/returns.pkl."""
    import cloudpickle
    from hydra.core.singleton import Singleton

    from expgpu import pool
    from expgpu.errors import exit_on_user_error

    state = Path((sys.argv[1:] if argv is None else argv)[0])
    jobs = cloudpickle.loads((state / JOBS).read_bytes())
    Singleton.set_state(jobs["singletons"])
    with exit_on_user_error():   # a stop (SIGUSR2, SIGTERM) ends it in KeyboardInterrupt, without returns
        returns = pool.launch(sweep_job.pool_params(jobs["pool"]), jobs["hydra_context"], jobs["task_function"],
                              jobs["config"], jobs["overrides"], jobs["first"])
    atomic_write_bytes(state / RETURNS, cloudpickle.dumps(returns))


if __name__ == "__main__":
    main()
