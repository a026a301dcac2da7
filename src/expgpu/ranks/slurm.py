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

The step's size comes from the SLURM_STEP_* variables. srun also rewrites SLURM_NTASKS, SLURM_NNODES
and SLURM_TASKS_PER_NODE to the step's values, except under `srun -E` (--preserve-env), which keeps
the allocation's (SLURM's env.c, env_array_for_step): a 2-task step in an 8-task allocation would
otherwise wait for 8 ranks. SLURM_JOB_NODELIST always stays the allocation's; SLURM_STEP_NODELIST is
the step's (a step may run on a subset of the job's nodes). The old names are read only where the
step's are missing (hand-made environments).

Which global ranks share a node: SLURM_GTIDS, which slurmstepd sets for every task (the task ids of
this node, by SLURM_LOCALID). With `-m cyclic`, `-m plane=N` or uneven counts like `2(x3),1` they
are not node_rank * tasks_per_node + local_rank. They only label the dry run's table: a task's own
rank, local rank and node are SLURM_PROCID, SLURM_LOCALID and SLURM_NODEID, whatever the layout.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import hostlist

from expgpu.errors import UserError, env_int, plural
from expgpu.ranks.info import RankInfo, build, env_port, env_str, is_set

log = logging.getLogger("expgpu")

MAX_NORMAL_STEP_ID = 0xFFFFFFF0
# field -> (the step's own variable, the older name srun -E leaves at the allocation's value)
STEP_VARIABLES = {
    "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
    "num_nodes": ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"),
    "tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    "hosts": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"),
}
# MASTER_PORT when the user set none: PORT_BASE + SLURM_JOB_ID % PORT_SPAN, 15000..32767. Linux
# hands out outgoing connections' ports from net.ipv4.ip_local_port_range, 32768-60999 by default,
# so a port below it cannot be taken by one while the job starts.
PORT_BASE, PORT_SPAN = 15000, 32768 - 15000
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)


def in_srun_step(env: Mapping[str, str]) -> bool:
    for name in ("SLURM_STEP_ID", "SLURM_STEPID"):
        if is_set(env, name):
            return env_int(env, name) <= MAX_NORMAL_STEP_ID
    return False


def step_variable(env: Mapping[str, str], field: str) -> str:
    """The variable to read ``field`` from: the step's own when srun set it."""
    step, old = STEP_VARIABLES[field]
    return step if is_set(env, step) else old


def hosts(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """(variable read, expanded host names) of the step's nodes."""
    name = step_variable(env, "hosts")
    raw = env_str(env, name)
    try:
        return name, hostlist.expand_hostlist(raw)
    except hostlist.BadHostlist as e:
        raise UserError(f"{name}={raw!r} is not a SLURM host list like 'gpu-[001-003,010],cpu7' ({e})") from None


def tasks_per_node(env: Mapping[str, str]) -> list[int]:
    name = step_variable(env, "tasks_per_node")
    raw = env_str(env, name)
    try:
        counts = hostlist.parse_slurm_tasks_per_node(raw)
    except hostlist.BadHostlist as e:
        raise UserError(f"{name}={raw!r} is not a task count list like '2(x3),1' ({e})") from None
    if not counts or min(counts) < 1:
        raise UserError(f"{name}={raw!r} must give at least 1 task for every node")
    return counts


def detect(env: Mapping[str, str]) -> RankInfo | None:
    if not in_srun_step(env):
        return None
    names = {"rank": "SLURM_PROCID", "local_rank": "SLURM_LOCALID", "node_rank": "SLURM_NODEID",
             "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
             **{field: step_variable(env, field) for field in ("world_size", "num_nodes")}}
    rank, world_size = env_int(env, "SLURM_PROCID"), env_int(env, names["world_size"], minimum=1)
    local_rank, node_rank = env_int(env, "SLURM_LOCALID"), env_int(env, "SLURM_NODEID")
    num_nodes = env_int(env, names["num_nodes"], minimum=1)
    counts, (nodelist_var, host_names) = tasks_per_node(env), hosts(env)
    counts_var = step_variable(env, "tasks_per_node")
    _check_layout(env, names, counts, host_names, world_size, num_nodes, node_rank)
    local_world_size = counts[node_rank]
    if local_rank >= local_world_size:
        raise UserError(
            f"SLURM_LOCALID='{local_rank}' must be < {local_world_size}, the tasks of node {node_rank} "
            f"in {counts_var}={env[counts_var]!r}"
        )
    names["local_world_size"] = f"{counts_var}[SLURM_NODEID]"
    ranks_on_node = node_labels(env, counts, node_rank, rank, local_rank, world_size)
    if is_set(env, "MASTER_ADDR"):
        master_addr = env_str(env, "MASTER_ADDR")
    else:  # rank 0 runs on the step's first node in every layout but a hostfile's (-m arbitrary)
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
        master_port=env_port(env, "MASTER_PORT") if is_set(env, "MASTER_PORT") else default_port(env, world_size),
        num_nodes=num_nodes,
        ranks_on_node=ranks_on_node,
    )


def _check_layout(env, names, counts, host_names, world_size, num_nodes, node_rank) -> None:
    """The step's task counts, node count and host list must describe the same nodes."""
    counts_var, nodelist_var = step_variable(env, "tasks_per_node"), step_variable(env, "hosts")
    nodes_var, tasks_var = names["num_nodes"], names["world_size"]

    def disagree(var: str, claim: str, other: str) -> UserError:
        return UserError(f"{var}={env[var]!r} {claim} but {other}")

    if len(counts) != num_nodes:
        raise disagree(counts_var, f"gives {plural(len(counts), 'node')}", f"{nodes_var}={num_nodes}")
    if sum(counts) != world_size:
        raise disagree(counts_var, f"sums to {plural(sum(counts), 'task')}", f"{tasks_var}={world_size}")
    if len(host_names) != num_nodes:
        raise disagree(nodelist_var, f"lists {plural(len(host_names), 'host')}", f"{nodes_var}={num_nodes}")
    if node_rank >= num_nodes:
        raise UserError(f"SLURM_NODEID='{node_rank}' must be < {nodes_var}={num_nodes}")


def node_labels(env: Mapping[str, str], counts: list[int], node_rank: int, rank: int, local_rank: int,
                world_size: int) -> tuple[int | None, ...]:
    """The global ranks of this node's tasks by SLURM_LOCALID, for the dry run's labels only.

    SLURM_PROCID, SLURM_LOCALID and SLURM_NODEID are the truth (a hostfile's -m arbitrary, a site's
    own layout, a test environment): where SLURM_GTIDS or the inferred layout disagree with them,
    or cannot be read, one warning says so and this node's other ranks are unknown (None, shown as ?).
    """
    unknown = tuple(rank if i == local_rank else None for i in range(counts[node_rank]))
    ids = f"SLURM_PROCID={rank} SLURM_LOCALID={local_rank} SLURM_NODEID={node_rank}"
    try:
        source, labels = node_tasks(env, counts, node_rank)
    except UserError as e:
        log.warning("%s used as they are; the dry run shows this node's other ranks as ?, since %s", ids, e)
        return unknown
    problem = None
    if len(labels) != len(unknown):
        problem = f"lists {plural(len(labels), 'task')} for this node, which has {len(unknown)}"
    elif len(set(labels)) != len(labels) or not all(0 <= r < world_size for r in labels):
        problem = f"does not list distinct ranks below {world_size}"
    elif labels[local_rank] != rank:
        problem = f"puts rank {labels[local_rank]} at local rank {local_rank}"
    if problem is not None:
        log.warning("%s used as they are (SLURM's own); %s (this node's ranks by it: %s) %s, so the dry run "
                    "shows this node's other ranks as ?", ids, source, ",".join(map(str, labels)), problem)
        return unknown
    return labels


def node_tasks(env: Mapping[str, str], counts: list[int], node_rank: int) -> tuple[str, tuple[int, ...]]:
    """(what it was read from, the global ranks of this node's tasks by SLURM_LOCALID).

    SLURM_GTIDS when set (slurmstepd always sets it; a site may strip it, as some third-party
    software trips on it), else the layout SLURM_DISTRIBUTION names, dealt as srun deals it.
    """
    if is_set(env, "SLURM_GTIDS"):
        raw = env["SLURM_GTIDS"].strip()
        if not re.fullmatch(r"[0-9]+(,[0-9]+)*", raw):
            raise UserError(f"SLURM_GTIDS={raw!r} must be the comma-separated task ids of this node, like '0,2,4'")
        return f"SLURM_GTIDS={raw!r}", tuple(int(t) for t in raw.split(","))
    raw = env.get("SLURM_DISTRIBUTION", "").strip()
    method = re.split(r"[:,]", raw)[0] if raw else "block"  # node level: before ':' (cores) or ',pack'
    if method == "block":
        chunk = max(counts)  # each node takes all of its tasks in turn
    elif method == "cyclic":
        chunk = 1
    elif method == "plane":
        chunk = env_int(env, "SLURM_DIST_PLANESIZE", minimum=1)
    else:
        raise UserError(f"SLURM_GTIDS is not set, and SLURM_DISTRIBUTION={raw!r} does not say which tasks "
                        "share a node: keep SLURM_GTIDS (srun sets it) in the tasks' environment")
    counts_var = step_variable(env, "tasks_per_node")
    layout = f"SLURM_DISTRIBUTION={raw!r}" if raw else "SLURM_DISTRIBUTION unset: block"
    source = f"the layout inferred from {layout} over {counts_var}={env[counts_var]!r}"
    return source, dealt(counts, chunk)[node_rank]


def dealt(counts: list[int], chunk: int) -> list[tuple[int, ...]]:
    """Task ids per node when tasks 0, 1, ... go out `chunk` at a time to each node in turn, a node
    taking no more than its count: SLURM's plane layout; chunk 1 is cyclic, chunk >= max(counts) block.

    For cyclic this is srun's layout unless the step overcommits its CPUs (then srun skips full
    nodes for a while, and SLURM_GTIDS, which is always right, tells).
    """
    tids: list[list[int]] = [[] for _ in counts]
    task, total = 0, sum(counts)
    while task < total:
        for node, count in enumerate(counts):
            take = min(chunk, count - len(tids[node]), total - task)
            tids[node].extend(range(task, task + take))
            task += take
    return [tuple(t) for t in tids]


def default_port(env: Mapping[str, str], world_size: int) -> int:
    """A port every task of the job computes alike without talking: 15000 + SLURM_JOB_ID % 17768.

    Lightning's SLURM default is alike (15000 + the job id's last 4 digits). Array tasks have their
    own SLURM_JOB_ID, so they differ; two steps running at once in one job collide, and need
    MASTER_PORT. A node whose ephemeral range covers the port (a widened ip_local_port_range) is
    refused in one line rather than risk an outgoing connection holding the port.
    """
    job_id = env_int(env, "SLURM_JOB_ID")
    port = PORT_BASE + job_id % PORT_SPAN
    low, high = ephemeral_ports(EPHEMERAL_PORTS)
    if world_size > 1 and low <= port <= high:
        raise UserError(
            f"MASTER_PORT is not set, and the port derived from SLURM_JOB_ID={job_id} ({port}) is in this "
            f"node's ephemeral range {low}-{high} (net.ipv4.ip_local_port_range), where outgoing "
            "connections may hold it: export MASTER_PORT=<a free port outside that range> in the job script"
        )
    return port


def ephemeral_ports(path: Path) -> tuple[int, int]:
    """This node's net.ipv4.ip_local_port_range; Linux's default where it cannot be read."""
    try:
        low, high = (int(p) for p in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high
