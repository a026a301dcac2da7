"""This node's plan, the same in every local process, and the dry-run view of it.

Every process of a node must agree on who gets which GPU. Strategies are pure, but
their input is not always stable: free memory and utilization change while the
first ranks start. So when the local ranks are separate processes started by a
launcher (torchrun, srun), local rank 0 computes the plan once and publishes it in
the run directory; the others read it. expgpu's own spawn computes it in the parent.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Mapping, Sequence

from expgpu import envvars
from expgpu.gpus import NodePlan, inventory, plan
from expgpu.ranks import RankInfo
from expgpu.rundir import atomic_write_bytes, node_plan_file, wait_for_file


def launch_id(env: Mapping[str, str]) -> str | None:
    """What is shared by the processes of one launch, and differs after a restart."""
    if env.get(envvars.LAUNCH_ID):
        return env[envvars.LAUNCH_ID]
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}.{env.get('SLURM_RESTART_COUNT', '0')}"
    return None


def compute(cfg: dict, local_world_size: int) -> NodePlan:
    gpus = scored(cfg, inventory(cfg["inventory"]["simulate"]))
    return plan(gpus, local_world_size, gpu_map_params(cfg))


def scored(cfg: dict, gpus: list) -> list:
    """gpu_map.score=measured: every GPU's score becomes its measured TFLOP/s (expgpu.gpus.measure:
    child processes and a cache, so this process starts no CUDA), which ranked orders by and
    data.shard=proportional sizes batches by."""
    gpu_map = cfg["gpu_map"]
    if not gpus or getattr(gpu_map.get("score"), "value", gpu_map.get("score")) != "measured":
        return gpus
    from expgpu.gpus import measure

    return measure.scored(gpus, gpu_map.get("measure_dtype") or "float32",
                          simulated=cfg["inventory"]["simulate"] is not None)


def pinned(cfg: dict, info: RankInfo, env: Mapping[str, str]) -> NodePlan | None:
    """The launcher already gave this process a GPU of its own (srun --gpus-per-task,
    torchrun --virtual-local-rank): a mask showing exactly one GPU while the node has
    several local ranks. Then that GPU is this rank's, whatever its local rank, and the
    other ranks' GPUs are not this process's to plan."""
    if info.local_world_size == 1 or not env.get("CUDA_VISIBLE_DEVICES"):
        return None
    gpus = inventory(cfg["inventory"]["simulate"], env)
    if len(gpus) != 1:
        return None
    gpus = scored(cfg, gpus)
    mine = tuple((gpus[0],) if r == info.local_rank else () for r in range(info.local_world_size))
    return NodePlan("inherited", mine, {}, tuple(gpus))


def gpu_map_params(cfg: dict) -> dict:
    params = dict(cfg["gpu_map"])
    # Config keys arrive as strings from the command line ("0"), as ints from YAML (0).
    params["scores"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                        for k, v in (params.get("scores") or {}).items()}
    return params


def shared(cfg: dict, info: RankInfo, run_dir: Path, timeout_s: float,
           env: Mapping[str, str] | None = None) -> NodePlan:
    env = os.environ if env is None else env
    own = pinned(cfg, info, env)
    if own is not None:
        return own
    launch = launch_id(env)
    if info.local_world_size == 1 or launch is None:
        return compute(cfg, info.local_world_size)
    path = node_plan_file(run_dir, socket.gethostname(), launch)
    if info.local_rank == 0:
        node = compute(cfg, info.local_world_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(node.to_dict()).encode())
        return node
    text = wait_for_file(path, timeout_s, f"local rank {info.local_rank}: local rank 0 published no GPU plan")
    return NodePlan.from_dict(json.loads(text))


def node_ranks(info: RankInfo, nproc: int) -> tuple[int | None, ...]:
    """The global rank of each of the ``nproc`` processes this node's plan is for, by local rank.

    A launcher's own processes (nproc == info.local_world_size): what it placed here, which with
    SLURM's cyclic or uneven layouts, or torchrun's different workers per node, is not
    node_rank * nproc + local_rank. Workers expgpu spawns under this process: spawn numbers
    them from this process's rank, one block of nproc per launcher task.
    """
    if nproc == info.local_world_size:
        return info.ranks_on_node or (None,) * nproc  # None: the launcher does not say (shown as ?)
    return tuple(range(info.rank * nproc, (info.rank + 1) * nproc))


def rows(node: NodePlan, ranks: Sequence[int | None], host: str | None = None) -> list[dict]:
    """One row per local rank, labelled with ``ranks[local_rank]``: what the dry-run table shows
    and plan.json stores."""
    host = host or socket.gethostname()
    if len(ranks) != len(node.assignments):
        raise ValueError(f"{len(ranks)} rank labels for a plan of {len(node.assignments)} local ranks")
    out = []
    for local_rank, gpus in enumerate(node.assignments):
        out.append({
            "rank": ranks[local_rank], "host": host, "local_rank": local_rank,
            "gpus": [g.index for g in gpus], "names": [g.name for g in gpus],
            "memory_mb": [g.memory_total_mb for g in gpus],
            "scores": [node.scores.get(g.index) for g in gpus],
            "device": "cuda" if gpus else "cpu",
        })
    return out


def table(plan_rows: list[dict], strategy: str) -> str:
    header = ("rank", "host", "local", "gpu", "name", "memory", "score")
    lines = [header]
    for r in plan_rows:
        fmt = lambda xs, f=str: ",".join(f(x) for x in xs) or "-"  # noqa: E731
        rank = "?" if r["rank"] is None else str(r["rank"])
        lines.append((rank, r["host"], str(r["local_rank"]), fmt(r["gpus"]) if r["gpus"] else "cpu",
                      fmt(r["names"]), fmt(r["memory_mb"], lambda m: f"{m / 1024:.0f} GiB"),
                      fmt(r["scores"], lambda s: "-" if s is None else f"{s:.4g}")))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
    return f"gpu_map={strategy}\n" + "\n".join(text)
