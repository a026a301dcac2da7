"""`hydra/launcher=slurm`, in any Hydra app: hydra-submitit-launcher, plus expgpu's checks before anything
is submitted and a dry run; and, in expgpu's own app, `hydra/launcher=submitit_local` (its conf dir's
submitit_local.yaml names ExpgpuLocalLauncher: other apps keep hydra-submitit-launcher's own, untouched).

    python -m expgpu -m hydra/launcher=slurm task=a,b gpu_map=sequential,ranked hydra.launcher.partition=gpu
    python my_app.py -m hydra/launcher=slurm lr=0.1,0.01 hydra.launcher.gpus_per_node=1

Submission, job arrays, pickling and each task's run_job stay hydra-submitit-launcher's; only launch()
differs (expgpu.slurm.launch): it checks the cluster (sbatch on PATH, controller answering, partition
known), notices a job that left the queue without a result, and for an expgpu config also derives
tasks/GPUs per node from the gpu_map, checks every job's config first and prints instead of submitting
under dry_run=true. Another app's jobs ask for what hydra.launcher says, as with submitit_slurm.

Hydra imports this module on every start, so it imports nothing heavy (expgpu.slurm lazily, inside
launch()), and it must not use `from __future__ import annotations`: Hydra's plugin scan executes
modules without registering them in sys.modules, where dataclasses look up string annotations.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore

from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher


@dataclass
class ExpgpuSlurmConf(SlurmQueueConf):
    """One job per combination of a sweep (a job array), each job nodes x tasks_per_node srun tasks; an
    expgpu job's ranks find their place from SLURM itself.
      python -m expgpu -m hydra/launcher=slurm task=a,b hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=4
    Before submitting: the partition and the controller, and for an expgpu config tasks/GPUs against the
    gpu_map; expgpu's dry_run=true prints the sbatch script and the plans instead.
    Site defaults (partition, account, qos, ...) go in hydra/launcher/slurm_site/default.yaml of a config
    dir on the search path (expgpu's conf/, a --config-dir, your app's own): read by SLURM sweeps only,
    so local runs never see them. Keys not listed here are hydra-submitit-launcher's (SlurmQueueConf)."""

    # Site defaults over the values below; command-line overrides over both.
    defaults: List[Any] = field(default_factory=lambda: ["_self_", {"optional slurm_site@_here_": "default"}])
    _target_: str = "hydra_plugins.expgpu_launchers.slurm.ExpgpuSlurmLauncher"
    partition: Optional[str] = None        # null: the cluster's default partition
    nodes: int = 1
    # GPUs per node. An expgpu config: null asks for what the ranks need, tasks_per_node x
    # gpu_map.gpus_per_rank; 0 asks for none (CPU ranks). Another app: as given, null asks for none.
    gpus_per_node: Optional[int] = None
    # srun tasks (ranks) per node. An expgpu config: null gives one per gpu_map.gpus_per_rank GPUs of
    # gpus_per_node (1 without GPUs). Another app: null is 1 (each task runs the task function).
    tasks_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None    # CPUs per rank (data loader workers + 1 is a good start)
    mem_gb: Optional[int] = None           # memory per node (GB)
    timeout_min: int = 60                  # time limit of each job
    # Times a job may be requeued after its time-limit warning (USR2): it checkpoints and resumes.
    max_num_timeout: int = 3
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None       # node features, e.g. a100|h100
    # Any other sbatch option, without the dashes: {reservation: mine, mail-type: END, exclusive: true}
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    # Where submitit keeps each job's pickles and stdout/stderr (%j: the job id)
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    # Seconds `scontrol ping` may take before the controller counts as unreachable.
    ping_timeout_s: float = 15.0
    # A job that left the queue this long ago without writing its result (scancel, node failure,
    # SIGKILL) fails the sweep instead of being waited for (submitit would wait forever without sacct).
    lost_after_s: float = 60.0


def _register_expgpu() -> None:
    # In the job: the unpickled config uses expgpu's resolvers, which live in the submitting process only.
    from expgpu import rundir, schema

    schema.register()
    rundir.register()


class _Expgpu:
    """What both submitit launchers do differently: expgpu's submission (checks, dry run, waiting
    for lost jobs; a bad setting is one line and exit code 2 in any app) and, in the job, expgpu's
    resolvers before the config is read."""

    def setup(self, *, hydra_context, task_function, config) -> None:
        from expgpu.pool import compose

        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        # the sweeper's check of each batch (it composes every job), composed fast
        compose.answer_checks(getattr(hydra_context, "config_loader", None))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        from expgpu.errors import exit_on_user_error
        from expgpu.schema import refuse_added_keys
        from expgpu.slurm import launch

        with exit_on_user_error():
            # a key added with + (+hydra.launcher.gpus=2): one line here, not submitit's traceback
            refuse_added_keys(self.params, self.conf, "hydra.launcher.")
            return launch.launch(self, job_overrides, initial_job_idx)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _register_expgpu()
        return super().__call__(*args, **kwargs)


class ExpgpuSlurmLauncher(_Expgpu, SlurmLauncher):
    conf = ExpgpuSlurmConf


class ExpgpuLocalLauncher(_Expgpu, LocalLauncher):
    conf = LocalQueueConf


ConfigStore.instance().store(group="hydra/launcher", name="slurm", node=ExpgpuSlurmConf, provider="expgpu")

