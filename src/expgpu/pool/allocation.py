"""The SLURM allocation a gpu_pool sweep runs inside (salloc, an sbatch script): its nodes, each node's
GPUs and CPUs, read from SLURM itself; and where a job's GPUs fit in it (pure).

Inside an allocation the pool's GPUs are the allocation's, on every node, not this machine's NVML
inventory: each job runs as an srun step (expgpu.pool.steps) on the node(s) whose GPUs it was given.
SLURM chooses which of a node's GPUs a step gets (--gres=gpu:N, no step can name GPU indices), and
never gives one GPU to two steps at once; the pool counts them per node, so it only starts a step
that fits, and a step never waits for GPUs that another of the sweep's steps holds. An allocation without
GPUs (or hydra.launcher.gpus_per_job=0) has CPU slots instead, hydra.launcher.cpu_slots per node.

What tells an allocation (seen on SLURM 22.05, slurm-local): SLURM_JOB_ID and SLURM_JOB_NODELIST are set,
in the batch script and in salloc's shell alike, but no srun step id (ranks.slurm.in_srun_step): the
pool inside a step (srun python -m expgpu -m ...) stays on the step's node, as a local pool.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from expgpu.errors import UserError

SCONTROL_TIMEOUT_S = 30
# A node's line of `scontrol show job -d`: "Nodes=gpu-[01-02] CPU_IDs=0-7 Mem=0 GRES=gpu:a100:4(IDX:0-3)"
NODE_LINE = re.compile(r"^\s*Nodes=(\S+)\s.*\bGRES=(\S*)", re.M)
GPU_IDX = re.compile(r"gpu(?::[^,(]*)?\(IDX:([^)]*)\)")


@dataclass(frozen=True)
class Slot:
    """One GPU of the allocation, as the pool counts them: a node and SLURM's index of it there.
    Which GPU of the node a step gets is SLURM's choice: the index only numbers the node's GPUs.
    Where the jobs take CPU slots (on_cpu_slots), one of a node's CPU slots (`cpu`), numbered from 0."""
    node: str
    index: int
    cpu: bool = False

    @property
    def name(self) -> str:
        return self.node


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]            # in SLURM's order
    gpus: dict[str, tuple[int, ...]]  # node -> its GPU indices (SLURM's IDX)
    cpus: dict[str, int]              # node -> the allocation's CPUs there
    mem_mb: int | None                # per node (SLURM_MEM_PER_NODE), None when memory is not asked for
    cpu: bool = False                 # `gpus` holds each node's CPU slots instead (on_cpu_slots)

    def slots(self) -> list[Slot]:
        return [Slot(node, i, self.cpu) for node in self.nodes for i in self.gpus[node]]

    @property
    def gpus_per_node(self) -> int:
        return max((len(g) for g in self.gpus.values()), default=0)

    def describe(self) -> str:
        counts = sorted({len(self.gpus[n]) for n in self.nodes})
        each = "/".join(map(str, counts))
        unit = "CPU slot(s)" if self.cpu else "GPU(s)"
        return f"SLURM job {self.job_id}: {len(self.nodes)} node(s) ({','.join(self.nodes)}) x {each} {unit}"


def cpu_jobs(alloc: Allocation, s) -> bool:
    """Whether the jobs take CPU slots, not GPUs: the allocation has none, or hydra.launcher.gpus_per_job=0
    (an --exclusive allocation is given its nodes' GPUs too, asked for or not)."""
    return not alloc.gpus_per_node or s.gpus_per_job == 0


def on_cpu_slots(alloc: Allocation, per_node: int) -> Allocation:
    """The allocation as the pool counts it when its jobs take CPU slots (cpu_jobs): `per_node` on each node
    (hydra.launcher.cpu_slots), a job one on each of its nodes, with that slot's share of the node's CPUs
    and memory (expgpu.pool.steps), and no GPU."""
    return dataclasses.replace(alloc, gpus={n: tuple(range(per_node)) for n in alloc.nodes}, cpu=True)


def in_allocation(env: Mapping[str, str]) -> bool:
    from expgpu.ranks.slurm import in_srun_step

    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST")) and not in_srun_step(env)


def detect(env: Mapping[str, str]) -> Allocation | None:
    """The allocation this process runs in, or None (not in one, or inside an srun step)."""
    if not in_allocation(env):
        return None
    import hostlist

    job_id = env["SLURM_JOB_ID"]
    nodes = tuple(hostlist.expand_hostlist(env["SLURM_JOB_NODELIST"]))
    gpus = _gpus(job_id, nodes, env)
    cpus = _cpus(nodes, env)
    mem = env.get("SLURM_MEM_PER_NODE")
    return Allocation(job_id, nodes, gpus, cpus, int(mem) if mem and mem.isdigit() else None)


def _gpus(job_id: str, nodes: Sequence[str], env: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    """Each node's GPUs from `scontrol show job -d` (nodes may differ); SLURM_GPUS_ON_NODE (this node's
    count, for every node) where scontrol does not answer."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-d", job_id], capture_output=True, text=True,
                             timeout=SCONTROL_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    found = node_gpus(out)
    if all(n in found for n in nodes):
        return {n: found[n] for n in nodes}
    raw = env.get("SLURM_GPUS_ON_NODE", "0")
    count = int(raw) if raw.isdigit() else 0
    return {n: tuple(range(count)) for n in nodes}


def node_gpus(scontrol_text: str) -> dict[str, tuple[int, ...]]:
    """node -> its GPU indices, from the per-node lines of `scontrol show job -d`."""
    import hostlist

    out: dict[str, tuple[int, ...]] = {}
    for nodes, gres in NODE_LINE.findall(scontrol_text):
        ids: list[int] = []
        for idx in GPU_IDX.findall(gres):
            ids += indices(idx)
        for node in hostlist.expand_hostlist(nodes):
            out[node] = tuple(ids)
    return out


def indices(text: str) -> list[int]:
    """'0-1,3' -> [0, 1, 3]."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        out += range(int(low), int(high or low) + 1)
    return out


def _cpus(nodes: Sequence[str], env: Mapping[str, str]) -> dict[str, int]:
    """SLURM_JOB_CPUS_PER_NODE ('8(x2),4'), node by node."""
    import hostlist

    raw = env.get("SLURM_JOB_CPUS_PER_NODE", "")
    try:
        counts = hostlist.parse_slurm_tasks_per_node(raw) if raw else []
    except hostlist.BadHostlist:
        counts = []
    if len(counts) != len(nodes):
        counts = [1] * len(nodes)
    return dict(zip(nodes, counts))


def check_job(label: str, need: int, nodes: int, alloc: Allocation, nodes_key: str, need_key: str) -> None:
    """A job that can never fit: one line (UserError) naming what it asks and what the allocation has.
    `nodes_key`, `need_key`: the settings that gave its nodes and its GPUs, for the hint."""
    if nodes > len(alloc.nodes):
        raise UserError(f"{label} asks for {nodes_key}={nodes}, but the allocation has "
                        f"{len(alloc.nodes)} node(s); allowed: 1..{len(alloc.nodes)} ({alloc.describe()})")
    if need % nodes:
        raise UserError(f"{label} needs {need} GPUs, not a multiple of {nodes_key}={nodes}; "
                        "ask for the same GPUs on every node")
    per_node = need // nodes
    most = sorted((len(g) for g in alloc.gpus.values()), reverse=True)[nodes - 1]
    if per_node > most:
        raise UserError(f"{label} needs {per_node} GPUs on each of {nodes} node(s), but the allocation has at "
                        f"most {most} GPU(s) per node ({alloc.describe()}); allowed: at most {most} per node "
                        f"({need_key}, over {nodes_key} nodes)")


def fit(free: Sequence[Slot], need: int, nodes: int) -> tuple[Slot, ...] | None:
    """`need` GPUs, need/nodes on each of `nodes` nodes, from the free ones; None when they do not fit.
    The nodes with the fewest free GPUs that still fit come first: whole nodes stay free for the jobs
    that need them (several nodes, a node's every GPU). Shared GPUs (hydra.launcher.jobs_per_gpu,
    expgpu.pool.sharing): a job's are different GPUs, and GPUs that no job uses are taken before a second
    share of any (its first shares fit as above; then its second, ...)."""
    levels = sorted({getattr(s, "share", 0) for s in free})
    for top in levels:
        taken = _fit([s for s in free if getattr(s, "share", 0) <= top], need, nodes)
        if taken is not None:
            return taken
    return None


def _fit(free: Sequence[Slot], need: int, nodes: int) -> tuple[Slot, ...] | None:
    per = need // nodes
    by_node: dict[str, dict[int, Slot]] = {}
    for slot in sorted(free, key=lambda s: getattr(s, "share", 0)):
        by_node.setdefault(slot.node, {}).setdefault(slot.index, slot)   # one share of each GPU, the first free
    fitting = sorted((n for n, s in by_node.items() if len(s) >= per), key=lambda n: len(by_node[n]))
    if len(fitting) < nodes:
        return None
    return tuple(s for n in fitting[:nodes] for s in list(by_node[n].values())[:per])
