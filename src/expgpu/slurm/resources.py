"""Tasks and GPUs per node for one job: the launcher's settings, completed from the job's gpu_map, checked
(derive); for another Hydra app's job, the launcher's settings alone (requested).

A rank needs gpu_map.gpus_per_rank GPUs. With SLURM, one srun task is one rank, so by default a job
asks for one task per rank and gpus_per_rank GPUs per task; launch.nproc_per_node=N instead starts
N ranks from one task per node (expgpu's own spawn). Checked here, on the submitting side, so a bad
combination fails in a second with one line instead of in every rank of a job that waited in the queue.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from expgpu.errors import UserError, shown

log = logging.getLogger("expgpu")


@dataclass(frozen=True)
class Resources:
    nodes: int
    tasks_per_node: int        # srun tasks per node
    gpus_per_node: int | None  # None: leave GPUs to gres / gpus_per_task / the local mask
    ranks_per_node: int        # tasks_per_node x launch.nproc_per_node

    def __str__(self) -> str:
        gpus = ("GPUs: gres / gpus_per_task (if set)" if self.gpus_per_node is None
                else f"{self.gpus_per_node} GPU(s) per node")
        return f"{self.nodes} node(s) x {self.tasks_per_node} task(s), {gpus}"


def count(params: Mapping, key: str, low: int, launcher: str, null: str | None = None) -> int | None:
    """hydra.launcher.<key>, an integer >= low or None; `null`: what null means, for the message (every SLURM
    launcher's counts are checked here, slurm_pool's too)."""
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"hydra.launcher.{key}={shown(value)} is not allowed: an integer >= {low}"
                        + (f" or null ({null})" if null else "") + f" (hydra/launcher={launcher})")
    return value


# hydra.launcher's other counts, checked before anything is submitted: sbatch would refuse them one job at a time,
# naming its own flag (`Invalid --mem specification`), not the key. key -> (lowest, what null means)
COUNTS = {"cpus_per_task": (1, "not asked"), "mem_gb": (1, "not asked"), "timeout_min": (0, None),
          "cpus_per_gpu": (1, "not asked"), "gpus_per_task": (1, "not asked"), "signal_delay_s": (0, None),
          "max_num_timeout": (0, None), "array_parallelism": (1, None)}


def check_counts(params: Mapping, launcher: str) -> None:
    """Each of COUNTS in `params` (hydra.launcher): an integer >= its lowest, or null where its schema allows it
    (a key typed int cannot be null there); one line naming the key otherwise."""
    for key, (low, null) in COUNTS.items():
        count(params, key, low, launcher, null)


def _local_gpus(gpus: int | None, visible_gpus: int | None) -> int | None:
    """GPUs a job of the local launcher sees: all this process sees unless fewer are asked for."""
    if gpus is None:
        return visible_gpus   # all this process sees, as without a launcher (hydra#2602)
    if visible_gpus is not None and gpus > visible_gpus:
        raise UserError(f"hydra.launcher.gpus_per_node={gpus} is more than the {visible_gpus} GPU(s) "
                        "this process sees; allowed: 0.." + str(visible_gpus) + " or null (all of them)")
    return gpus


def requested(params: Mapping, launcher: str = "slurm", visible_gpus: int | None = None) -> Resources:
    """A job of another Hydra app (no gpu_map, no launch section): what hydra.launcher asks for, read as
    hydra-submitit-launcher reads it: tasks_per_node 1 unless given, gpus_per_node as given (null: no GPU
    request; the local launcher: all this process sees). Each task runs the app's task function once."""
    nodes = count(params, "nodes", 1, launcher) or 1
    tasks = count(params, "tasks_per_node", 1, launcher, "1") or 1
    gpus = count(params, "gpus_per_node", 0, launcher,
                  "no GPU request" if launcher == "slurm" else "all the GPUs this process sees")
    if launcher != "slurm":
        if nodes > 1:
            raise UserError(f"hydra.launcher.nodes={nodes} is not allowed: hydra/launcher={launcher} runs every "
                            "job on this machine (1 node); for several nodes use hydra/launcher=slurm")
        gpus = _local_gpus(gpus, visible_gpus)
    return Resources(nodes, tasks, gpus, tasks)


def derive(params: Mapping, cfg: Mapping, launcher: str = "slurm", visible_gpus: int | None = None) -> Resources:
    """`params`: hydra.launcher; `cfg`: the job's config (gpu_map, launch). `visible_gpus`: for the
    local launcher, how many GPUs this process sees."""
    gpu_map, nproc = cfg["gpu_map"], cfg["launch"]["nproc_per_node"]
    k, share, strategy = gpu_map["gpus_per_rank"], gpu_map["share"], str(gpu_map["strategy"])
    nodes = count(params, "nodes", 1, launcher) or 1
    tasks = count(params, "tasks_per_node", 1, launcher, "derived from gpu_map")
    gpus = count(params, "gpus_per_node", 0, launcher, "derived from gpu_map")
    if launcher != "slurm":
        if nodes > 1 or (tasks or 1) > 1:
            raise UserError(f"hydra.launcher.nodes={nodes}, tasks_per_node={tasks}: hydra/launcher={launcher} runs "
                            "one process per job on this machine; for several ranks use launch.nproc_per_node=N")
        tasks = 1
        gpus = _local_gpus(gpus, visible_gpus)
    if tasks is not None and tasks > 1 and nproc > 1:
        raise UserError(f"hydra.launcher.tasks_per_node={tasks} and launch.nproc_per_node={nproc}: let one of them "
                        "start the ranks of a node; set launch.nproc_per_node=1 (srun starts them) or tasks_per_node=1")
    own_gpu_request = any(params.get(key) for key in ("gres", "gpus_per_task")) or any(
        str(key).lstrip("-").replace("_", "-") in ("gres", "gpus", "gpus-per-task", "gpus-per-node")
        for key in (params.get("additional_parameters") or {}))
    if own_gpu_request:
        # The user asked for GPUs their own way (gres=gpu:a100:4, gpus_per_task): don't add a second request.
        if gpus is not None:
            raise UserError("hydra.launcher.gpus_per_node and a gres/gpus_per_task/additional_parameters GPU "
                            "request both ask for GPUs; keep one of them")
        tasks = tasks or 1
        return Resources(nodes, tasks, None, tasks * nproc)

    if tasks is None:
        if nproc > 1 or not gpus:
            tasks = 1
        else:
            if gpus % k:
                raise UserError(f"hydra.launcher.gpus_per_node={gpus} is not a multiple of gpu_map.gpus_per_rank={k}; "
                                f"ask for a multiple of {k} GPUs, or set hydra.launcher.tasks_per_node")
            tasks = gpus // k
    ranks = tasks * nproc
    need = ranks * k
    if gpus is None:
        gpus = need
    if gpus == 0:
        return Resources(nodes, tasks, 0, ranks)   # CPU ranks
    listed = gpu_map.get("gpus")
    # custom: one entry per rank; the other strategies choose among the listed GPUs (ranks may share them)
    if listed is not None and len(listed) < need and (strategy == "custom" or not (share and k == 1)):
        raise UserError(f"gpu_map.gpus={list(listed)} lists {len(listed)} GPU(s), but "
                        f"{ranks} rank(s) per node x gpu_map.gpus_per_rank={k} need {need}")
    if need > gpus and not (share and k == 1):
        how = "launch.nproc_per_node" if nproc > 1 else "hydra.launcher.tasks_per_node"
        raise UserError(f"{how}={nproc if nproc > 1 else tasks} rank(s) per node x gpu_map.gpus_per_rank={k} need "
                        f"{need} GPU(s) per node, but hydra.launcher.gpus_per_node={gpus}; set "
                        f"hydra.launcher.gpus_per_node={need}, {how}={gpus // k} (or null: one rank per "
                        "GPU), or gpu_map.share=true")
    if need < gpus and launcher == "slurm":
        log.warning("hydra.launcher.gpus_per_node=%d but %d rank(s) x %d GPU(s) use %d: gpu_map=%s picks among "
                    "them and the rest idle", gpus, ranks, k, need, strategy)
    return Resources(nodes, tasks, gpus, ranks)
