"""A composed expgpu config (expgpu.schema's, as conf/config.yaml composes it): the range checks its
types cannot say (`check()`, one line naming the key), and what the run reads from it.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, ListConfig, OmegaConf

from expgpu.errors import UserError, shown
from expgpu.schema import CheckpointFormat, DdpConfig, FsdpConfig, HangConfig, OnHang, Shard, Wrap, refuse_added_keys
from expgpu.task import SUPERVISED

# What makes a composed config expgpu's (this schema, as conf/config.yaml composes it): expgpu's launchers
# also launch any other Hydra app's jobs, and read a job's task, gpu_map and launch only when it has them.
SECTIONS = ("task", "gpu_map", "launch")


def is_expgpu(cfg) -> bool:
    """Whether `cfg` is an expgpu config, not another Hydra app's (whose `task` may well be a number)."""
    return all(isinstance(OmegaConf.select(cfg, key, default=None), DictConfig) for key in SECTIONS)


def check(cfg: DictConfig) -> None:
    """Range checks that types cannot express; one line naming the key on failure."""
    def need(ok: bool, key: str, allowed: str) -> None:
        if not ok:
            raise UserError(f"{key}={shown(OmegaConf.select(cfg, key))} is not allowed: {allowed}")

    need(isinstance(cfg.task, DictConfig), "task", "a task file: a function (_target_) and its parameters, "
         "or the built-in loop's (model, dataset, optimizer, ...)")
    _check_added_keys(cfg)
    obj = cfg.objective
    need(obj is None or isinstance(obj, str) or (isinstance(obj, ListConfig) and len(obj) > 0
                                                  and all(isinstance(o, str) for o in obj)),
         "objective", "null, a metric name the task returns (e.g. eval_loss), or a list of names")
    need(cfg.launch.nproc_per_node >= 1, "launch.nproc_per_node", "an integer >= 1")
    need(cfg.launch.nodes >= 1, "launch.nodes", "an integer >= 1")
    need(cfg.backend.timeout_s > 0, "backend.timeout_s", "seconds > 0")
    _check_hang(cfg, need)
    need(cfg.gpu_map.gpus_per_rank >= 1, "gpu_map.gpus_per_rank", "an integer >= 1")
    need(0 <= cfg.gpu_map.max_util <= 100, "gpu_map.max_util", "a percentage 0..100")
    need(cfg.gpu_map.min_free_mb >= 0, "gpu_map.min_free_mb", "megabytes >= 0")
    need(cfg.data.num_workers >= 0, "data.num_workers", "an integer >= 0")
    need(cfg.data.auto_steps >= 2, "data.auto_steps", "an integer >= 2 (steps measured before the rebalance)")
    if cfg.data.weights is not None:
        need(len(cfg.data.weights) >= 1 and all(math.isfinite(w) and w > 0 for w in cfg.data.weights),
             "data.weights", "a list of numbers > 0, one per rank, e.g. [3, 1]")
        need(cfg.data.shard is not Shard.uniform, "data.weights", "null under data.shard=uniform, where every rank "
             "takes task.batch_size: set data.shard=proportional to size the ranks' batches by these weights")
    need(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", "0 (off) or a step count")
    poll = cfg.checkpoint.poll_every
    need(poll == "auto" or (type(poll) is int and poll >= 1), "checkpoint.poll_every", "auto or an integer >= 1")
    f = cfg.faults
    need((f.crash_rank is None) == (f.crash_step is None), "faults.crash_step",
         "set faults.crash_rank and faults.crash_step together")
    if f.crash_rank is not None:
        need(f.crash_rank >= 0, "faults.crash_rank", "a rank >= 0")
        need(f.crash_step >= 0, "faults.crash_step", "a step >= 0")
    need(f.crash_attempts is None or f.crash_attempts >= 1, "faults.crash_attempts",
         "null (every attempt) or an integer >= 1 (the first N attempts of the run)")
    need(math.isfinite(f.slow_factor) and f.slow_factor >= 1, "faults.slow_factor", "a number >= 1")
    need(math.isfinite(f.device_ms_per_example) and f.device_ms_per_example >= 0,
         "faults.device_ms_per_example", "milliseconds >= 0")
    if f.slow_rank is not None:
        need(f.slow_rank >= 0, "faults.slow_rank", "a rank >= 0")
    _check_fsdp(cfg, need)
    _check_ddp(cfg, need)
    if cfg.launch.wrap is Wrap.dp and cfg.launch.nproc_per_node > 1:
        need(False, "launch.wrap", "dp (DataParallel) runs in one process; use ddp with several ranks")


def _check_added_keys(cfg: DictConfig) -> None:
    """A key added with `+` inside one of expgpu's sections (`+launch.backend=mpi`): Hydra adds it, and nothing
    would read it. The root takes new keys (`+note=baseline`, kept in the run's config.yaml), and `task` is
    checked against its function's signature (expgpu.task); `hydra` is Hydra's, its plugins check their own."""
    for section in cfg.keys():
        node = cfg._get_node(section)
        if section not in ("task", "hydra") and isinstance(node, DictConfig) and not node._is_none():
            refuse_added_keys(node, OmegaConf.get_type(node), f"{section}.")


def _check_hang(cfg: DictConfig, need) -> None:
    """launch.hang, launch.on_hang and launch.max_restarts, together: a key that only the watchdog reads is
    an error when the watchdog is off, not a setting that silently changes nothing."""
    hang = cfg.launch.hang.timeout_s
    need(hang is None or hang == "auto" or (isinstance(hang, (int, float)) and not isinstance(hang, bool)
                                            and math.isfinite(hang) and hang > 0),
         "launch.hang.timeout_s", "auto, a number of seconds > 0, or null (no watchdog)")
    need(math.isfinite(cfg.launch.hang.slow_phase_s) and cfg.launch.hang.slow_phase_s > 0, "launch.hang.slow_phase_s",
         "a number of seconds > 0")
    need(cfg.launch.max_restarts >= 0, "launch.max_restarts", "an integer >= 0")
    need(cfg.launch.on_hang is not OnHang.restart or cfg.launch.max_restarts >= 1, "launch.on_hang",
         "fail, or restart with launch.max_restarts >= 1 (how many times the world may start again)")
    if hang is None:
        need(cfg.launch.hang.slow_phase_s == HangConfig.slow_phase_s, "launch.hang.slow_phase_s",
             f"{HangConfig.slow_phase_s:g} (its default) under launch.hang.timeout_s=null, which turns off the "
             "watchdog that reads it: set launch.hang.timeout_s=auto or seconds, or drop the key")
        # A script task's output watch (task.output_timeout_s) finds hangs without the watchdog.
        need(cfg.launch.on_hang is not OnHang.restart or OmegaConf.select(cfg, "task.output_timeout_s") is not None,
             "launch.on_hang", "fail under launch.hang.timeout_s=null: no watchdog finds a hang to restart after; "
             "set launch.hang.timeout_s=auto or seconds")


def _check_fsdp(cfg: DictConfig, need) -> None:
    """launch.fsdp and the sharded checkpoint's keys, against launch.wrap."""
    fsdp = cfg.launch.wrap is Wrap.fsdp
    if fsdp:
        need(cfg.gpu_map.gpus_per_rank == 1, "gpu_map.gpus_per_rank",
             "1 with launch.wrap=fsdp (several GPUs per rank is launch.wrap=dp's DataParallel)")
        need(cfg.checkpoint.format is not CheckpointFormat.pt, "checkpoint.format",
             "auto or dcp with launch.wrap=fsdp (a sharded model is saved by every rank)")
        units = cfg.launch.fsdp.units
        need(units is None or (len(units) > 0 and all(isinstance(u, str) and u for u in units)),
             "launch.fsdp.units", "null or a list of module class names, e.g. [Block]")
    else:
        _only_with(cfg, "fsdp", FsdpConfig, need)
    need(not cfg.checkpoint.async_save or checkpoint_format(cfg) == "dcp", "checkpoint.async_save",
         "true only with the sharded format (launch.wrap=fsdp or checkpoint.format=dcp)")


def _check_ddp(cfg: DictConfig, need) -> None:
    """launch.ddp, DDP's own options, against launch.wrap."""
    if cfg.launch.wrap is not Wrap.ddp:
        _only_with(cfg, "ddp", DdpConfig, need)
    cap = cfg.launch.ddp.bucket_cap_mb
    need(cap is None or (math.isfinite(cap) and cap > 0), "launch.ddp.bucket_cap_mb",
         "null (DDP's own, 25) or megabytes > 0")


def _only_with(cfg: DictConfig, wrap: str, schema: type, need) -> None:
    """launch.<wrap>'s keys are that wrap's: one set under another launch.wrap would change nothing."""
    changed = [k for k, v in OmegaConf.structured(schema).items() if cfg.launch[wrap][k] != v]
    if changed:
        need(False, f"launch.{wrap}.{changed[0]}", f"set only with launch.wrap={wrap}")


def check_world(plain: dict, world: int) -> None:
    """What needs the run's world size, known once the ranks are counted (srun's tasks, torchrun's world).
    `plain` after script.prepare, which puts a script task's command in plain["script"]."""
    builtin = (plain["task"].get("_target_") or SUPERVISED) == SUPERVISED and plain.get("script") is None
    if world > 1 and plain["launch"]["wrap"] in ("none", Wrap.none) and builtin:
        raise UserError(f"launch.wrap=none on {world} ranks: the built-in loop would train {world} separate "
                        "models, each on its share of the data with no gradient sync, and keep rank 0's; use "
                        "launch.wrap=ddp (the default) or fsdp, or one rank")


def checkpoint_format(cfg) -> str:
    """pt or dcp: what checkpoint.format=auto means for this run's launch.wrap."""
    fmt, wrap = cfg.checkpoint.format, cfg.launch.wrap
    fmt, wrap = getattr(fmt, "value", fmt), getattr(wrap, "value", wrap)
    return ("dcp" if wrap == "fsdp" else "pt") if fmt == "auto" else fmt


def plain(cfg: DictConfig) -> dict:
    """Resolved, enum-free dict: what pure functions and child processes receive."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def objective(cfg, result: dict | None):
    """What the Hydra task function returns for an optimizing sweeper: the metric(s) named by
    `objective`, as a float or a tuple of floats; the whole result when none is named."""
    names = cfg.get("objective")
    if names is None or result is None or result.get("status") != "finished":
        return result
    wanted = [names] if isinstance(names, str) else list(names)
    metrics = result.get("metrics") or {}
    missing = [n for n in wanted if metrics.get(n) is None]
    if missing:
        have = ", ".join(k for k, v in metrics.items() if v is not None) or "nothing"
        raise UserError(f"objective={missing[0]}: the task returned no metric {missing[0]!r}; it returned "
                        f"{have} (name one of those, or return it from the task function)")
    values = [float(metrics[n]) for n in wanted]
    return values[0] if isinstance(names, str) else tuple(values)
