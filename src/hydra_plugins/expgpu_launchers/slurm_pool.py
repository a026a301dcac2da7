"""`hydra/launcher=slurm_pool`: a whole sweep or study as one SLURM job, its jobs packed onto the allocation's
GPUs by gpu_pool (each an srun step), so the queue is paid once, not per trial.

    python -m expgpu -m hydra/launcher=slurm_pool hydra.launcher.nodes=2 hydra.launcher.gpus_per_node=4 \\
        task=a,b gpu_map.gpus_per_rank=1,2 hydra.launcher.partition=gpu
    python -m expgpu -m hydra/launcher=slurm_pool hydra/sweeper=expgpu_optuna ...   # the study inside

The first launch() (an optimizing sweeper: its start) submits the same command with hydra/launcher=gpu_pool
as the allocation's script, follows it and ends with the sweep's exit code (expgpu.slurm.sweep_job). Called
in-process, with no command line to run again, each launch() sends its jobs to an allocation and returns
their results (expgpu.slurm.sweep_batch).
Hydra imports this module on every start: nothing heavy here, and no `from __future__ import annotations`
(Hydra's plugin scan executes modules without registering them in sys.modules).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore

from hydra_plugins.expgpu_launchers.gpu_pool import GpuPoolLauncher


@dataclass
class PoolInsideConf:
    """gpu_pool's settings inside the allocation (hydra/launcher=gpu_pool's keys of the same names)."""
    gpus_per_job: Optional[int] = None
    max_parallel: Optional[int] = None
    nodes: Optional[int] = None            # per job; null: each job's launch.nodes
    grace_s: float = 15.0
    threads_per_job: Optional[int] = None
    wait_timeout_s: Optional[float] = None
    warm_starts: bool = True               # jobs forked by a warm process per node (gpu_pool's key)
    timeout_min: Optional[float] = None    # each job's time limit from its start (minutes; null or 0: none)
    cpu_slots: int = 1                     # with gpus_per_node=0: jobs at once on each node, each its share of it
    jobs_per_gpu: int = 1                  # jobs on one GPU at once (forked by warm_starts), each its share of it


@dataclass
class SlurmPoolLauncherConf:
    _target_: str = "hydra_plugins.expgpu_launchers.slurm_pool.SlurmPoolLauncher"
    # The allocation
    nodes: int = 1
    gpus_per_node: int = 1                 # 0: a CPU allocation, its jobs on pool.cpu_slots per node
    cpus_per_node: Optional[int] = None    # null: whole nodes (--exclusive), their CPUs shared out per step
    mem_gb: Optional[int] = None           # memory per node (GB); null: SLURM's default
    timeout_min: int = 60                  # the whole sweep's time limit
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # Any other sbatch option, without the dashes: {reservation: mine, mail-type: END}
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    # gpu_pool's settings inside the allocation: hydra.launcher.pool.max_parallel=4, ...
    pool: PoolInsideConf = field(default_factory=PoolInsideConf)
    # Before its time limit (SLURM's SIGUSR2, signal_delay_s ahead) the running trials save and the allocation
    # requeues itself, at most this many times; run again, the sweep keeps its finished jobs, resumes the cut
    # ones from their checkpoints, and a study continues from its journal. 0: it only saves and stops.
    max_requeues: int = 3
    signal_delay_s: int = 120
    # Submit, say how to follow, and return at once (else: follow until the sweep ends; Ctrl-C detaches)
    detach: bool = False
    ping_timeout_s: float = 15.0


ConfigStore.instance().store(group="hydra/launcher", name="slurm_pool", node=SlurmPoolLauncherConf,
                             provider="expgpu")


class SlurmPoolLauncher(GpuPoolLauncher):
    """gpu_pool's launcher (its set-up), whose jobs run in one SLURM allocation rather than here."""

    conf = SlurmPoolLauncherConf

    def setup(self, *, hydra_context, task_function, config) -> None:
        from pathlib import Path

        from expgpu.errors import exit_on_user_error
        from expgpu.slurm import sweep_job

        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        # before the sweeper writes in the sweep dir (multirun.yaml, a study's journal): a sweep whose allocation
        # is still in SLURM's queue is refused in one line (its processes run on another node)
        with exit_on_user_error():
            sweep_job.refuse_live(Path(str(config.hydra.sweep.dir)).absolute())

    def can_take_over(self) -> bool:
        """Whether this process was started by the sweep's command line, which the allocation can run again."""
        import sys

        from expgpu.slurm import sweep_job

        return sweep_job.started_by_command_line(self.config, sys.orig_argv[1:])

    def take_over(self, job_overrides: Sequence[Sequence[str]] = ()) -> None:
        """The whole sweep as one SLURM job; ends this process (SystemExit) with the sweep's exit code."""
        from expgpu.errors import exit_on_user_error
        from expgpu.slurm import sweep_job

        with exit_on_user_error():
            sweep_job.take_over(self.params, self.config, self.hydra_context, job_overrides)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        if self.can_take_over():
            self.take_over(job_overrides)
        from expgpu.errors import exit_on_user_error
        from expgpu.slurm import sweep_batch

        with exit_on_user_error():   # called in-process: these jobs themselves, in an allocation of their own
            return sweep_batch.launch(self.params, self.config, self.hydra_context, self.task_function,
                                      job_overrides, initial_job_idx)
