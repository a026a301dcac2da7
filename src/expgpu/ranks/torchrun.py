"""torchrun / torch elastic, and plain ``env://`` launches that set RANK, WORLD_SIZE, MASTER_ADDR.

Checked before SLURM and MPI: torchrun is often started by srun (one agent per node), so its
workers also carry the step's SLURM_PROCID/SLURM_NTASKS, which count agents, not workers.

torch gives each agent (node) a contiguous block of ranks, the sum of the workers of the nodes
before it onwards (elastic agent, _assign_worker_ranks), also when nodes run different numbers of
workers: a node's ranks are RANK - LOCAL_RANK + 0 .. LOCAL_WORLD_SIZE - 1, which RankInfo derives.
"""

from __future__ import annotations

from collections.abc import Mapping

from expgpu.errors import UserError, env_int
from expgpu.ranks.info import RankInfo, build, env_port, env_str, is_set

NAMES = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "num_nodes": "GROUP_WORLD_SIZE",
}
# torchrun's own default --master-port; a plain env:// launcher that leaves MASTER_PORT unset
# gets the same value on every rank, so they still meet.
DEFAULT_PORT = 29500


def launched(env: Mapping[str, str]) -> bool:
    """torchrun always sets TORCHELASTIC_RUN_ID in its workers; any other env:// launcher sets
    WORLD_SIZE. A stray RANK or LOCAL_RANK, or WORLD_SIZE=1 alone, keeps no other process waiting."""
    if is_set(env, "TORCHELASTIC_RUN_ID"):
        return True
    return is_set(env, "WORLD_SIZE") and (is_set(env, "RANK") or env["WORLD_SIZE"].strip() != "1")


def detect(env: Mapping[str, str]) -> RankInfo | None:
    if not launched(env):
        return None
    rank = env_int(env, "RANK")
    world_size = env_int(env, "WORLD_SIZE", minimum=1)
    names = dict(NAMES)
    if is_set(env, "LOCAL_RANK"):
        local_rank = env_int(env, "LOCAL_RANK")
        if not is_set(env, "LOCAL_WORLD_SIZE"):
            # Guessing the node size from WORLD_SIZE would be wrong on every multi-node run.
            raise UserError(
                "environment variable LOCAL_WORLD_SIZE is not set but LOCAL_RANK is; set it to the "
                "number of processes on this node (torchrun sets both)"
            )
        local_world_size = env_int(env, "LOCAL_WORLD_SIZE", minimum=1)
        if is_set(env, "GROUP_RANK"):
            node_rank = env_int(env, "GROUP_RANK")
        else:  # block placement, what torchrun and every env:// launcher we know of use
            node_rank, names["node_rank"] = rank // local_world_size, "RANK // LOCAL_WORLD_SIZE"
    else:
        # No per-node variables at all: a single-node env:// launch, so this node is the world.
        local_rank, local_world_size, node_rank = rank, world_size, 0
        names.update(local_rank="RANK", local_world_size="WORLD_SIZE", node_rank="GROUP_RANK (unset, 0)")
    num_nodes = env_int(env, "GROUP_WORLD_SIZE", minimum=1) if is_set(env, "GROUP_WORLD_SIZE") else 0
    return build(
        "torchrun",
        names,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr(env, world_size),
        master_port=env_port(env, "MASTER_PORT", DEFAULT_PORT),
        num_nodes=num_nodes,
    )


def master_addr(env: Mapping[str, str], world_size: int) -> str:
    if is_set(env, "MASTER_ADDR"):
        return env_str(env, "MASTER_ADDR")
    if world_size == 1:
        return "127.0.0.1"  # nobody to meet
    # Running anyway as a world of one would train alone while the other ranks wait for it.
    raise UserError(f"environment variable MASTER_ADDR is not set, and WORLD_SIZE={world_size} needs the "
                    "host of rank 0 to meet at: set MASTER_ADDR (torchrun sets it)")
