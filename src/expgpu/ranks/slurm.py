"""SLURM, but only inside an srun step: one process per task, placed by SLURM.

What tells an srun task from the rest of an allocation, seen on SLURM 22.05 (slurm-local):
- the batch script (sbatch, --wrap or not) has SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NODEID=0 and,
  with --ntasks-per-node=2, SLURM_NTASKS=2: it looks like rank 0 of 2, and would wait forever
  for a rank 1 that never comes. It has no SLURM_STEP_ID / SLURM_STEPID.
- a plain salloc shell has SLURM_NTASKS=2 but no SLURM_PROCID and no step id.
- salloc's interactive step (LaunchParameters=use_interactive_step, `srun --interactive`) has
  SLURM_PROCID=0, SLURM_NTASKS=2 and SLURM_STEP_ID=4294967290: a pseudo step.
- every srun step (in sbatch, in salloc, or srun alone) has SLURM_STEP_ID = SLURM_STEPID = 0, 1, ...
So a step is SLURM_STEP_ID (or SLURM_STEPID) <= SLURM_MAX_NORMAL_STEP_ID; the ids above it are
slurm.h's pseudo steps (interactive 0xfffffffa, batch 0xfffffffb, extern 0xfffffffc, pending 0xfffffffd).

Inside a step srun rewrites SLURM_NTASKS, SLURM_NNODES and SLURM_TASKS_PER_NODE to the step's
values, but SLURM_JOB_NODELIST stays the whole job's; SLURM_STEP_NODELIST is the step's, so it
wins when set (a step may run on a subset of the job's nodes).
"""

from __future__ import annotations

from collections.abc import Mapping

import hostlist

from expgpu.errors import UserError, env_int
from expgpu.ranks.info import RankInfo, build, env_port, env_str, is_set, plural

MAX_NORMAL_STEP_ID = 0xFFFFFFF0
NAMES = {
    "rank": "SLURM_PROCID",
    "local_rank": "SLURM_LOCALID",
    "world_size": "SLURM_NTASKS",
    "local_world_size": "SLURM_TASKS_PER_NODE[SLURM_NODEID]",
    "node_rank": "SLURM_NODEID",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "num_nodes": "SLURM_NNODES",
}


def in_srun_step(env: Mapping[str, str]) -> bool:
    for name in ("SLURM_STEP_ID", "SLURM_STEPID"):
        if is_set(env, name):
            return env_int(env, name) <= MAX_NORMAL_STEP_ID
    return False


def hosts(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """(variable read, expanded host names) of the step's nodes."""
    name = "SLURM_STEP_NODELIST" if is_set(env, "SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    raw = env_str(env, name)
    try:
        return name, hostlist.expand_hostlist(raw)
    except hostlist.BadHostlist as e:
        raise UserError(f"{name}={raw!r} is not a SLURM host list like 'gpu-[001-003,010],cpu7' ({e})") from None


def tasks_per_node(env: Mapping[str, str]) -> list[int]:
    raw = env_str(env, "SLURM_TASKS_PER_NODE")
    try:
        counts = hostlist.parse_slurm_tasks_per_node(raw)
    except hostlist.BadHostlist as e:
        raise UserError(f"SLURM_TASKS_PER_NODE={raw!r} is not a task count list like '2(x3),1' ({e})") from None
    if not counts or min(counts) < 1:
        raise UserError(f"SLURM_TASKS_PER_NODE={raw!r} must give at least 1 task for every node")
    return counts


def detect(env: Mapping[str, str]) -> RankInfo | None:
    if not in_srun_step(env):
        return None
    rank, world_size = env_int(env, "SLURM_PROCID"), env_int(env, "SLURM_NTASKS", minimum=1)
    local_rank, node_rank = env_int(env, "SLURM_LOCALID"), env_int(env, "SLURM_NODEID")
    num_nodes = env_int(env, "SLURM_NNODES", minimum=1)
    counts, (nodelist_var, host_names) = tasks_per_node(env), hosts(env)
    raw_tasks = env["SLURM_TASKS_PER_NODE"]

    def disagree(var: str, claim: str, other: str) -> UserError:
        return UserError(f"{var}={env[var]!r} {claim} but {other}")

    if len(counts) != num_nodes:
        raise disagree("SLURM_TASKS_PER_NODE", f"gives {plural(len(counts), 'node')}", f"SLURM_NNODES={num_nodes}")
    if sum(counts) != world_size:
        raise disagree("SLURM_TASKS_PER_NODE", f"sums to {plural(sum(counts), 'task')}", f"SLURM_NTASKS={world_size}")
    if len(host_names) != num_nodes:
        raise disagree(nodelist_var, f"lists {plural(len(host_names), 'host')}", f"SLURM_NNODES={num_nodes}")
    if node_rank >= num_nodes:
        raise UserError(f"SLURM_NODEID='{node_rank}' must be < SLURM_NNODES={num_nodes}")
    local_world_size = counts[node_rank]
    if local_rank >= local_world_size:
        raise UserError(
            f"SLURM_LOCALID='{local_rank}' must be < {local_world_size}, the tasks of node {node_rank} "
            f"in SLURM_TASKS_PER_NODE={raw_tasks!r}"
        )
    names = dict(NAMES)
    if is_set(env, "MASTER_ADDR"):
        master_addr = env_str(env, "MASTER_ADDR")
    else:  # rank 0 always runs on the step's first node, whatever the task distribution
        master_addr, names["master_addr"] = host_names[0], nodelist_var
    return build(
        "slurm",
        names,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=env_port(env, "MASTER_PORT") if is_set(env, "MASTER_PORT") else default_port(env),
        num_nodes=num_nodes,
    )


def default_port(env: Mapping[str, str]) -> int:
    """A port every task of the job computes alike without talking: 15000 + SLURM_JOB_ID % 20000.

    Lightning derives its port from the job id the same way. Array tasks have their own
    SLURM_JOB_ID, so they differ; two steps running at once in one job collide, and need MASTER_PORT.
    """
    return 15000 + env_int(env, "SLURM_JOB_ID") % 20000
