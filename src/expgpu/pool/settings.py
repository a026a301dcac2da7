"""hydra.launcher.* of the gpu_pool, checked (one line naming the key on bad input), and what a job needs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from expgpu.errors import UserError


@dataclass(frozen=True)
class Settings:
    gpus: tuple[int, ...] | None     # None: all
    gpus_per_job: int | None
    max_parallel: int | None
    cpu_slots: int
    lease_dir: str | None
    wait_timeout_s: float | None
    grace_s: float
    threads_per_job: int | None = None   # None: the cores shared out among the jobs at once
    nodes: int | None = None             # inside a SLURM allocation; None: each job's launch.nodes
    max_requeues: int = 0                # inside a batch allocation: its requeues on SIGUSR2 (expgpu.pool.requeue)
    warm_starts: bool = True             # inside an allocation: jobs forked by a warm process per node
    timeout_min: float | None = None     # a job's time limit from its start (expgpu.pool.loop); None: none
    jobs_per_gpu: int = 1                # jobs on one GPU at once (expgpu.pool.sharing)
    busy_gpus: str = "wait"              # a GPU other processes compute on: wait for it, or use it (pool.busy)


def settings(params: Mapping[str, Any]) -> Settings:
    from omegaconf import OmegaConf

    p = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
         for k, v in params.items()}
    lease = p.get("lease_dir")
    if lease is not None and not (isinstance(lease, str) and lease.strip()):
        raise UserError(f"hydra.launcher.lease_dir={lease!r} is not allowed: a directory path or null")
    return Settings(gpus=_gpus(p.get("gpus", "all")), gpus_per_job=_whole(p, "gpus_per_job", 0, True),
                    max_parallel=_whole(p, "max_parallel", 1, True), cpu_slots=_whole(p, "cpu_slots", 1, False),
                    lease_dir=lease, wait_timeout_s=_seconds(p, "wait_timeout_s", True),
                    grace_s=_seconds(p, "grace_s", False),
                    threads_per_job=_whole(p, "threads_per_job", 1, True), nodes=_whole(p, "nodes", 1, True),
                    max_requeues=_whole({"max_requeues": 0, **p}, "max_requeues", 0, False),
                    warm_starts=_flag(p, "warm_starts"), timeout_min=_minutes(p, "timeout_min"),
                    jobs_per_gpu=_whole({"jobs_per_gpu": 1, **p}, "jobs_per_gpu", 1, False),
                    busy_gpus=_choice(p, "busy_gpus", ("wait", "use")))


def _choice(p: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    value = p.get(key, allowed[0])
    if value not in allowed:
        raise UserError(f"hydra.launcher.{key}={value!r} is not allowed: {' or '.join(allowed)}")
    return value


def _flag(p: Mapping[str, Any], key: str) -> bool:
    value = p.get(key, True)
    if not isinstance(value, bool):
        raise UserError(f"hydra.launcher.{key}={value!r} is not allowed: true or false")
    return value


def _whole(p: Mapping[str, Any], key: str, low: int, none_ok: bool) -> int | None:
    value = p.get(key)
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        allowed = f"an integer >= {low}" + (" or null" if none_ok else "")
        raise UserError(f"hydra.launcher.{key}={value!r} is not allowed: {allowed}")
    return value


def _seconds(p: Mapping[str, Any], key: str, none_ok: bool) -> float | None:
    value = p.get(key)
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
            or not math.isfinite(value):
        raise UserError(f"hydra.launcher.{key}={value!r} is not allowed: seconds >= 0"
                        + (" or null" if none_ok else ""))
    return float(value)


def _minutes(p: Mapping[str, Any], key: str) -> float | None:
    value = p.get(key)
    if value is None or (value == 0 and not isinstance(value, bool)):   # 0: none, as SLURM's --time=0
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise UserError(f"hydra.launcher.{key}={value!r} is not allowed: minutes > 0 (e.g. 90 or 0.5), or 0 or "
                        "null for no limit")
    return float(value)


def _gpus(gpus: Any) -> tuple[int, ...] | None:
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        gpus = [gpus]
    if gpus == "all" or gpus is None:
        return None
    if isinstance(gpus, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        if len(set(gpus)) != len(gpus):
            raise UserError(f"hydra.launcher.gpus={gpus}: a GPU is listed twice; list each once")
        return tuple(gpus)
    raise UserError(f"hydra.launcher.gpus={gpus!r} is not allowed: all, or a list of GPU indices "
                    "as nvidia-smi numbers them, e.g. [0,2]")


def pool_gpus(s: Settings, simulate: Any = None) -> list:
    """The GPUs this sweep may lease: the inventory (NVML, or simulated), narrowed by an inherited
    CUDA_VISIBLE_DEVICES, then by hydra.launcher.gpus."""
    from expgpu.gpus import inventory

    visible = inventory(simulate)
    if s.gpus is None:
        return visible
    by_index = {g.index: g for g in visible}
    for i in s.gpus:
        if i not in by_index:
            mask = os.environ.get("CUDA_VISIBLE_DEVICES")
            if not by_index:   # `all` then runs the jobs on CPU slots (hydra.launcher.cpu_slots)
                shown = f" (CUDA_VISIBLE_DEVICES={mask!r})" if mask is not None else ""
                raise UserError(f"hydra.launcher.gpus: GPU {i} is not on this machine, which shows no GPU{shown}; "
                                "allowed: all (here: the CPU slots)")
            why = f" (CUDA_VISIBLE_DEVICES={mask!r} hides the others)" if mask is not None else ""
            seen = ", ".join(str(g) for g in sorted(by_index))
            raise UserError(f"hydra.launcher.gpus: GPU {i} is not on this machine; allowed: all, or "
                            f"a list of {seen}{why}")
    return [by_index[i] for i in s.gpus]


def job_nodes(cfg: Any, s: Settings) -> tuple[int, str]:
    """(the nodes a job spreads its GPUs over, the key that said so): hydra.launcher.nodes, else what its
    expgpu config asks for (launch.nodes: a sweep may vary it), 1 for another Hydra app."""
    from expgpu import config

    if s.nodes is not None:
        return s.nodes, "hydra.launcher.nodes"
    if not config.is_expgpu(cfg):
        return 1, "hydra.launcher.nodes"
    value = cfg.launch.nodes
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"launch.nodes={value!r} is not allowed: an integer >= 1")
    return value, "launch.nodes"


def need_in_allocation(cfg: Any, s: Settings, alloc, nodes: int) -> int:
    """What a job of `nodes` nodes takes inside a SLURM allocation (expgpu.pool.allocation.Allocation): a CPU
    slot on each of its nodes in one without GPUs, else job_need's GPUs on each (gpus_per_job: in all)."""
    if alloc.cpu:
        return nodes
    return job_need(cfg, s, len(alloc.slots())) * (nodes if s.gpus_per_job is None else 1)


def job_need(cfg: Any, s: Settings, pool_size: int) -> int:
    """GPUs a job needs: hydra.launcher.gpus_per_job, else what its expgpu config asks for."""
    from expgpu import config

    if pool_size == 0:
        return 0
    if s.gpus_per_job is not None:
        return s.gpus_per_job
    if not config.is_expgpu(cfg):
        return 1   # another Hydra app: one GPU per job
    nproc, per_rank = int(cfg.launch.nproc_per_node), int(cfg.gpu_map.gpus_per_rank)
    # share: ranks take turns on the GPUs they are given, so a job can run on one rank's worth
    return per_rank if cfg.gpu_map.share else nproc * per_rank
