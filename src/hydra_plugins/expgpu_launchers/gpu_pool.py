"""`hydra/launcher=gpu_pool`: a local sweep, one job per free GPU (or CPU slot), in parallel.

    python -m expgpu -m hydra/launcher=gpu_pool task=a,b,digits task.optimizer.lr=1e-3,1e-2
    salloc -N 2 --gres=gpu:4 python -m expgpu -m hydra/launcher=gpu_pool task=a,b launch.nodes=1,2

Each job is a process of its own, started ahead (torch imported), that sees only its GPU(s)
(CUDA_VISIBLE_DEVICES set before any of the job's code runs) and its share of the CPU cores; the
next job starts the moment GPUs free up; GPUs are leased machine-wide, so two sweeps never share
one. Inside a SLURM allocation, the pool is the allocation's GPUs on every node, and each job is
an srun step on the node(s) it was given (expgpu.pool.steps). Hydra imports this module on every
start: the work lives in the expgpu.pool package, imported inside launch().
"""

# No `from __future__ import annotations`: Hydra executes plugin modules without registering
# them in sys.modules, and dataclasses cannot resolve string annotations there.
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher


@dataclass
class GpuPoolLauncherConf:
    _target_: str = "hydra_plugins.expgpu_launchers.gpu_pool.GpuPoolLauncher"
    # "all", or a list of NVML indices (as nvidia-smi numbers them) the sweep may use. An inherited
    # CUDA_VISIBLE_DEVICES narrows "all"; with inventory.simulate the simulated GPUs are the pool.
    gpus: Any = "all"
    # GPUs per job. null: what each job's config asks for, launch.nproc_per_node x gpu_map.gpus_per_rank
    # (gpus_per_rank alone with gpu_map.share=true; 1 for a non-expgpu app). 0: jobs take CPU slots.
    gpus_per_job: Optional[int] = None
    # At most this many jobs at once (null: as many as the GPUs / CPU slots allow).
    max_parallel: Optional[int] = None
    # Jobs on one GPU at once, for models too small to keep a GPU busy alone: each GPU counts as this many
    # shares, a job takes one share of each GPU it needs (never two of one), jobs spread over the GPUs
    # before they double up; they share its memory (expgpu.pool.sharing). Inside a SLURM allocation, with
    # warm_starts (its srun steps never share a GPU): each share gets its part of its GPU's CPUs.
    jobs_per_gpu: int = 1
    # A GPU that a process outside expgpu computes on (nvidia-smi lists it; a colleague's job, a notebook):
    # "wait" for it to free, as for a GPU another sweep leased (wait_timeout_s applies); "use" it anyway.
    busy_gpus: str = "wait"
    # Jobs at once that use no GPU: on a machine (or a `gpus: []` pool) without GPUs, or gpus_per_job=0;
    # inside a SLURM allocation without GPUs, on each of its nodes.
    cpu_slots: int = 1
    # Where the per-GPU lock files live (null: $EXPGPU_LEASE_DIR, else ~/.cache/expgpu/leases).
    # Sweeps that must not share GPUs (two terminals, two users) use the same directory.
    lease_dir: Optional[str] = None
    # Give up on queued jobs (they fail) after waiting this long for GPUs leased by other sweeps
    # while none of this sweep's jobs runs (null: wait as long as those leases are held).
    wait_timeout_s: Optional[float] = None
    # After Ctrl-C / SIGTERM: how long running jobs get to checkpoint and exit before SIGKILL.
    grace_s: float = 15.0
    # A job's time limit, in minutes from its start (hydra-submitit-launcher's key; there SLURM's): a job
    # still running then gets SIGTERM (an expgpu job saves its checkpoint and ends; a rerun of the sweep
    # resumes it), SIGKILL grace_s later, and fails, naming this key. A hung trial frees its GPUs and
    # counts as a failure for the sweeper. null or 0: no limit (as SLURM's --time=0).
    timeout_min: Optional[float] = None
    # CPU threads per job (OMP_NUM_THREADS, MKL_NUM_THREADS, torch.set_num_threads). null: the
    # cores shared out among the jobs that can run at once, unless OMP/MKL_NUM_THREADS is set; torch
    # would otherwise start one thread per core in every job and oversubscribe the cores.
    threads_per_job: Optional[int] = None
    # Nodes per job, inside a SLURM allocation (salloc, sbatch): its GPUs spread evenly over this many
    # nodes, one srun step. null: what each job's config asks for, launch.nodes (a sweep may vary it,
    # launch.nodes=1,2; 1 for a non-expgpu app). Outside an allocation: 1.
    nodes: Optional[int] = None
    # Inside a batch allocation (sbatch, hydra/launcher=slurm_pool), on SIGUSR2 (SLURM's warning before the
    # time limit, --signal=B:USR2@N): the running jobs save, and the allocation requeues itself at most this
    # many times; run again (same command, same hydra.sweep.dir) it keeps the finished jobs and resumes
    # the cut ones from their checkpoints. 0: it only stops.
    max_requeues: int = 0
    # Inside a SLURM allocation: one warm process per node (torch imported, an srun step with --overlap)
    # forks each job, which gets its GPUs (CUDA_VISIBLE_DEVICES) and their share of the node's CPUs
    # (affinity); false: each job is an srun step of its own, confined by SLURM, that starts cold.
    warm_starts: bool = True


ConfigStore.instance().store(group="hydra/launcher", name="gpu_pool", node=GpuPoolLauncherConf,
                             provider="expgpu")


class GpuPoolLauncher(Launcher):
    conf = GpuPoolLauncherConf   # its keys: a key added with + (+hydra.launcher.gpu=1) is one line, exit 2

    def __init__(self, **params: Any) -> None:
        import os

        from expgpu import envvars
        from expgpu.errors import UserError, exit_on_user_error
        from expgpu.schema import refuse_added_keys

        with exit_on_user_error():
            refuse_added_keys(params, self.conf, "hydra.launcher.")
            misspelt = envvars.misspelt(os.environ)   # EXPGPU_LEASEDIR: leases where no other sweep looks
            if misspelt:
                raise UserError(misspelt)
        self.params = params
        self.config = None
        self.hydra_context = None
        self.task_function = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        from expgpu.pool import compose
        from expgpu.pool.launch import start_server_ahead

        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        # the sweeper's check of each batch (it composes every job), composed fast, and each checked
        # config kept for the job's launch
        compose.answer_checks(getattr(hydra_context, "config_loader", None), keep=True)
        # torch imported in the sweep's fork server while the sweeper checks the jobs or opens its study
        start_server_ahead(self.params, config)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from expgpu import pool
        from expgpu.errors import exit_on_user_error

        with exit_on_user_error():   # a bad setting: one line and exit code 2, in any Hydra app
            return pool.launch(self.params, self.hydra_context, self.task_function, self.config,
                               job_overrides, initial_job_idx)
