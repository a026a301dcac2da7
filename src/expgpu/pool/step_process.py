"""One gpu_pool job inside a SLURM allocation, in each task of its srun step:
`srun ... python -m expgpu.pool.step_process JOB_FILE` (expgpu.pool.steps starts it).

Every task runs the job as Hydra's launchers do (expgpu.pool.job_process.run_job: the launcher's
import path, its context file, the job's config), as every task of hydra-submitit-launcher's jobs
does: expgpu's app in it finds its rank from SLURM's variables, as under any srun step. The first
task (SLURM_PROCID 0) sends the JobReturn back; the step's exit code is the launcher's verdict.
The job's environment (threads, MASTER_PORT, EXPGPU_POOL_JOB) came with srun's; its GPUs are the
ones SLURM gave the step (CUDA_VISIBLE_DEVICES), and no others.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from expgpu import envvars, procs
from expgpu.pool.job_process import run_job


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    os.environ.setdefault(envvars.START_TIME, str(time.time()))
    code = run_job(Path(args[0]), send_back=os.environ.get("SLURM_PROCID", "0") == "0")
    procs.fast_exit(code)


if __name__ == "__main__":
    main()
