"""Typed schema of an expgpu run, registered in Hydra's ConfigStore.

conf/config.yaml lists `expgpu_schema` first in its defaults, so every YAML file and
command-line override is merged onto these dataclasses: a misspelt key or a value of
the wrong type is rejected while Hydra composes, before anything runs. Enums give the
allowed values in the error message. expgpu.config.check() adds the range checks a type cannot say.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from expgpu.task import RUN_KEYS


class Strategy(enum.Enum):
    sequential = "sequential"
    custom = "custom"
    ranked = "ranked"
    free_memory = "free_memory"


class ScoreSource(enum.Enum):
    spec = "spec"          # SM count x max clock (then memory), or gpu_map.scores
    measured = "measured"  # a short matmul benchmark per GPU, cached per UUID


class MeasureDtype(enum.Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Backend(enum.Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Isolation(enum.Enum):
    auto = "auto"                          # visible_devices for a function task; a script task: below
    visible_devices = "visible_devices"
    set_device = "set_device"


class Wrap(enum.Enum):
    ddp = "ddp"
    dp = "dp"
    none = "none"
    fsdp = "fsdp"


class CheckpointFormat(enum.Enum):
    auto = "auto"   # dcp under launch.wrap=fsdp, else pt
    pt = "pt"       # checkpoint.pt: rank 0 writes the whole state (expgpu/checkpoint/file.py)
    dcp = "dcp"     # checkpoint/: every rank writes its own shards (expgpu/checkpoint/sharded.py)


class Stdout(enum.Enum):
    all = "all"
    rank0 = "rank0"


class Shard(enum.Enum):
    uniform = "uniform"
    proportional = "proportional"
    auto = "auto"


class WandbMode(enum.Enum):
    offline = "offline"    # written under the run dir only; `wandb sync` uploads it later
    online = "online"
    disabled = "disabled"


class OnHang(enum.Enum):
    fail = "fail"         # stop every rank, free the GPUs, exit 124 (a crash exits 1)
    restart = "restart"   # stop every rank and start the world again from the last checkpoint


class FaultKind(enum.Enum):
    exception = "exception"  # the rank raises RuntimeError
    kill = "kill"     # the rank SIGKILLs itself (a segfault, the OOM killer)
    hang = "hang"     # the rank sleeps for good (a stuck data loader, a dead file system): the watchdog's case


@dataclass
class GpuMapConfig:
    strategy: Strategy = Strategy.sequential
    gpus: Optional[List[int]] = None            # custom: NVML index per local rank; others: GPUs to pick from
    scores: Dict[Any, float] = field(default_factory=dict)  # ranked: by index, name or UUID
    score: ScoreSource = ScoreSource.spec       # ranked: where default scores come from
    measure_dtype: MeasureDtype = MeasureDtype.float32  # score=measured: the dtype the task computes in
    min_free_mb: int = 0                        # free_memory: skip GPUs with less free memory
    max_util: int = 100                         # free_memory: skip GPUs busier than this (%)
    gpus_per_rank: int = 1
    share: bool = False                         # allow more ranks than GPUs (round-robin)


@dataclass
class BackendConfig:
    name: Backend = Backend.auto   # auto: nccl when every rank has its own CUDA device, else gloo
    timeout_s: float = 300.0       # process-group init and every collective


@dataclass
class FsdpConfig:
    # module class names, each instance one FSDP unit (e.g. [Block]); null: the model's direct
    # children that hold parameters. The root is sharded last, over what is left.
    units: Optional[List[str]] = None
    reshard_after_forward: bool = True   # the units' (the root keeps its gathered parameters forward->backward)
    cpu_offload: bool = False            # shards, gradients and optimizer state in host memory (CPUOffloadPolicy)


@dataclass
class DdpConfig:
    # DistributedDataParallel's own options, for every module run.wrap wraps in DDP (run.wrap's keyword
    # arguments win for their module). True: a step may leave parameters out of its loss (a head of another
    # task, a branch not taken); DDP then walks the autograd graph after each forward to find them.
    find_unused_parameters: bool = False
    static_graph: bool = False             # the same parameters used (or not) in every step: checked once, faster
    gradient_as_bucket_view: bool = False  # gradients as views into DDP's buckets: less memory, one copy fewer
    bucket_cap_mb: Optional[float] = None  # megabytes of gradients per all-reduce; null: DDP's own (25)


@dataclass
class HangConfig:
    # A run of several ranks is hung when no rank has finished a step for this long (a rank behind is
    # named, with its stack; expgpu.train.watchdog). auto: 20 x the slowest rank's recent step time,
    # at least 50 s; a number of seconds; null: no watchdog.
    timeout_s: Any = "auto"
    # The first step (compiling, loading), a checkpoint save and `with run.phase(...)` blocks (the built-in
    # loop's evaluation) may take this long before they count as hung.
    slow_phase_s: float = 600.0


@dataclass
class LaunchConfig:
    nproc_per_node: int = 1                       # >1: expgpu starts this many local workers
    # Under hydra/launcher=gpu_pool inside a SLURM allocation: the nodes this job's GPUs (and its ranks,
    # one srun task per node, each with nproc_per_node ranks) are spread over (expgpu/pool/steps.py).
    nodes: int = 1
    # auto: a function task's rank sees only its GPU(s) (visible_devices); a script task's ranks
    # see the node's planned GPUs in local-rank order, so cuda:LOCAL_RANK is each one's own
    # (expgpu/script/environ.py). visible_devices: only its own; set_device: all, then set_device
    isolation: Isolation = Isolation.auto
    wrap: Wrap = Wrap.ddp                         # dp: DataParallel over a rank's GPUs (1 rank only)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)   # wrap=fsdp: FSDP2 (expgpu/distributed/fsdp.py)
    ddp: DdpConfig = field(default_factory=DdpConfig)      # wrap=ddp: DDP's own options
    # what the task prints: every rank's on the console, or rank0's only (the others' in logs/rank<N>.out)
    stdout: Stdout = Stdout.all
    hang: HangConfig = field(default_factory=HangConfig)   # the progress watchdog of a run
    on_hang: OnHang = OnHang.fail                          # restart: needs max_restarts >= 1
    # After a rank crashes (or hangs, with on_hang=restart), every rank is stopped and the world starts
    # again from the last checkpoint, in the same run dir, up to this many times.
    max_restarts: int = 0
    # Under SLURM (scripts/expgpu.sbatch), a restart after a crash or a hang that was one node's (the failing
    # rank's node; a hang's culprits all on one node) runs without that node: the next srun step with --exclude
    # when the allocation has another node for it, else the job requeued with the node in its ExcNodeList when
    # the partition has enough other nodes, else on the same nodes (one line says which). result.json's
    # excluded_nodes lists them (expgpu/launch/bad_nodes.py).
    exclude_bad_nodes: bool = True
    # Started by hand on this machine's GPUs (not torchrun, srun, a pool job): the run leases its GPUs as a
    # gpu_pool job does, planned around those other expgpu jobs lease (expgpu/launch/run_leases.py). false:
    # it plans on every GPU and leases none (a GPU shared with a sweep's job, on purpose).
    lease_gpus: bool = True


@dataclass
class InventoryConfig:
    # A list of {name, memory_mb, free_mb?, util?, sm_count?, clock_mhz?, score?, processes?}
    # that replaces NVML, to preview or test a plan on any machine. The run itself
    # then trains on the CPU.
    simulate: Optional[List[Any]] = None


@dataclass
class DataConfig:
    # uniform: every rank takes task.batch_size; proportional: each rank's share of the global
    # batch (task.batch_size x world size) follows its speed (data.weights, else its GPU score);
    # auto: measured over the first auto_steps steps, then rebalanced once. docs/proportional-batches.md
    shard: Shard = Shard.uniform
    num_workers: int = 0   # DataLoader workers per rank
    weights: Optional[List[float]] = None  # proportional/auto: one relative speed per rank, rank 0 first
    auto_steps: int = 20   # auto: steps measured before the rebalance


@dataclass
class CheckpointConfig:
    every_steps: int = 0   # 0: only when stopped (signal, preemption) and at the end
    resume: bool = True    # resume from the run dir's checkpoint when there is one
    # Steps between the ranks' stop polls (a signal stops them within 2x this); auto: about
    # 0.2 s worth of steps, measured as training goes (expgpu/stop_signals.py)
    poll_every: Any = "auto"
    format: CheckpointFormat = CheckpointFormat.auto   # auto: dcp for wrap=fsdp, else pt
    # dcp: write in the background (after a copy to host memory); a stop's save is synchronous
    async_save: bool = False
    # Check that the task resumes exactly: train it uninterrupted and, beside it, stopped half-way and
    # resumed (in RUN_DIR/verify/), then compare parameters and logged rows (expgpu/checkpoint/verify.py)
    verify: bool = False


@dataclass
class FaultsConfig:
    crash_rank: Optional[int] = None  # inject a crash on this rank ...
    crash_step: Optional[int] = None  # ... at this step (both needed)
    crash_attempts: Optional[int] = None  # ... in the run's first N attempts only (launch.max_restarts); null: every
    kind: FaultKind = FaultKind.exception
    slow_rank: Optional[int] = None   # tests/bench: make this (CPU) rank ...
    slow_factor: float = 1.0          # ... this many times slower (sleeps (f-1) x its compute time)
    device_ms_per_example: float = 0.0  # bench: every rank sleeps this per example (an emulated device)
    slow_write_s: float = 0.0         # tests: a background checkpoint save (async_save) takes this much longer


# logger=csv (the default), logger=[csv,tensorboard], logger=none: each chosen logger's settings
# appear under logger.<name> (conf/logger/<name>.yaml); the others stay null. expgpu/loggers/.
@dataclass
class CsvLoggerConfig:
    file: str = "metrics.csv"         # beside metrics.jsonl in the run dir


@dataclass
class TensorBoardLoggerConfig:
    dir: str = "tensorboard"          # under the run dir; a sweep's jobs each add a subdir named by their overrides


@dataclass
class MlflowLoggerConfig:
    # null: $MLFLOW_TRACKING_URI if set, else sqlite:///<sweep dir or run dir>/mlflow.db (offline, local)
    tracking_uri: Optional[str] = None
    # null: the sweep dir in a multirun (one experiment per sweep), else hydra.job.name
    experiment: Optional[str] = None


@dataclass
class WandbLoggerConfig:
    project: str = "expgpu"
    entity: Optional[str] = None
    mode: WandbMode = WandbMode.offline  # online needs `wandb login` (or WANDB_API_KEY)
    group: Optional[str] = None          # null: the sweep dir in a multirun (one group per sweep)
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    csv: Optional[CsvLoggerConfig] = None
    tensorboard: Optional[TensorBoardLoggerConfig] = None
    mlflow: Optional[MlflowLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None


@dataclass
class Config:
    # A training function and its parameters, or the built-in loop's (expgpu/task.py checks them
    # against the function's signature: every function has its own keys).
    task: Dict[str, Any] = field(default_factory=lambda: dict(RUN_KEYS))
    gpu_map: GpuMapConfig = field(default_factory=GpuMapConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    inventory: InventoryConfig = field(default_factory=InventoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)   # where metrics go besides metrics.jsonl
    dry_run: bool = False  # print the rank -> GPU plan, write plan.json, exit without CUDA
    # A metric the task returns (or a list of them) that the Hydra task function returns in turn,
    # for optimizing sweepers: objective=eval_loss with hydra/sweeper=optuna.
    objective: Any = None


def register() -> None:
    from hydra.core.config_store import ConfigStore

    schema = OmegaConf.structured(Config)
    # Any parameter of the task function may be set as task.<name>=..., listed in the task file or
    # not (its default is in Python): expgpu/task.py checks each against the function's signature
    # and names a misspelt one, so Hydra's "+ to append" is not needed under task.
    OmegaConf.set_struct(schema.task, False)
    ConfigStore.instance().store(name="expgpu_schema", node=schema)


def refuse_added_keys(node: Any, kind: Any, where: str) -> None:
    """One line (UserError) for the first key of `node` (a mapping) at any depth that its dataclass `kind` does not
    have: a key added with `+` (`+launch.backend=mpi`, `+hydra.launcher.gpu=1`) that nothing would read. `where`
    is the node's dotted path with its dot (`launch.`); nested typed nodes are checked by their own type."""
    import dataclasses

    from expgpu.errors import UserError

    if not dataclasses.is_dataclass(kind):
        return
    known = [f.name for f in dataclasses.fields(kind)]
    for key in node.keys():
        if key not in known:
            raise UserError(f"{where}{key}: unknown key; allowed under {where[:-1]}: {', '.join(known)} "
                            "(a key added with + here is read by nothing)")
        child = node._get_node(key) if OmegaConf.is_config(node) else node[key]
        if OmegaConf.is_dict(child) and not child._is_none():
            refuse_added_keys(child, OmegaConf.get_type(child), f"{where}{key}.")


def schema_keys(path: str) -> list[str] | None:
    """The allowed keys under a dotted path of the schema (for 'unknown key' messages)."""
    import dataclasses

    node: Any = Config
    for part in [p for p in path.split(".") if p]:
        if not dataclasses.is_dataclass(node):
            return None
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return None
        f = fields[part]
        node = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        node = type(node) if dataclasses.is_dataclass(node) else node
    if dataclasses.is_dataclass(node):
        return [f.name for f in dataclasses.fields(node)]
    return None
