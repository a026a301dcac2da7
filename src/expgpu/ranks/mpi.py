"""mpirun / mpiexec: Open MPI, and MPICH or Intel MPI (Hydra's PMI variables).

MPI launchers place processes but run no rendezvous store for torch.distributed, so
MASTER_ADDR must come from the user (e.g. ``mpirun -x MASTER_ADDR=host0``) once there is
more than one process.
"""

from __future__ import annotations

from collections.abc import Mapping

from expgpu.errors import UserError, env_int
from expgpu.ranks.info import RankInfo, build, env_port, env_str, is_set

# One table per launcher family, keyed by the variable that says it is present.
# OMPI_COMM_WORLD_NODE_RANK is deliberately unused: Open MPI documents it as "the relative rank
# of this process on this node looking across all jobs", a per-node process rank, not a node index.
FLAVORS = (
    {
        "rank": "OMPI_COMM_WORLD_RANK",
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
    {
        "rank": "PMI_RANK",
        "world_size": "PMI_SIZE",
        "local_rank": "MPI_LOCALRANKID",
        "local_world_size": "MPI_LOCALNRANKS",
    },
)
DEFAULT_PORT = 29500  # torchrun's default, so a mixed setup meets on the usual port


def detect(env: Mapping[str, str]) -> RankInfo | None:
    table = next((t for t in FLAVORS if is_set(env, t["rank"])), None)
    if table is None:
        return None
    names = {**table, "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}
    rank = env_int(env, table["rank"])
    world_size = env_int(env, table["world_size"], minimum=1)
    if is_set(env, table["local_rank"]):
        local_rank = env_int(env, table["local_rank"])
        local_world_size = env_int(env, table["local_world_size"], minimum=1)
        # Block placement (ranks fill a node before the next), mpirun's default; --map-by node breaks it.
        node_rank = rank // local_world_size
        names["node_rank"] = f"{table['rank']} // {table['local_world_size']}"
    else:
        # A PMI launcher that gives no per-node variables: assume one node, as for plain env://.
        local_rank, local_world_size, node_rank = rank, world_size, 0
        names.update(local_rank=table["rank"], local_world_size=table["world_size"])
    if is_set(env, "MASTER_ADDR"):
        master_addr = env_str(env, "MASTER_ADDR")
    elif world_size == 1:
        master_addr = "127.0.0.1"
    else:
        raise UserError(
            f"environment variable MASTER_ADDR is not set, and an MPI launch of {world_size} processes "
            "needs it: set it to the host of rank 0 (e.g. mpirun -x MASTER_ADDR=<host> ...)"
        )
    return build(
        "mpi",
        names,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=env_port(env, "MASTER_PORT", DEFAULT_PORT),
    )
