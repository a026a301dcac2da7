"""Who am I? Rank resolution from the environment a launcher left for this process.

Each source module has ``detect(env) -> RankInfo | None``: None when its launcher did not start
this process, UserError (one line naming the variable) when it did but the values are unusable.
The first source that answers wins, innermost launcher first:

    local     expgpu's own spawn; set for this very child, so even an srun step's variables lose
    torchrun  often started by srun, one agent per node; its workers still carry the step's SLURM_*
    slurm     srun tasks only: a batch script or salloc shell is not a task (see slurm.py)
    mpi       mpirun / mpiexec
    single    nothing matched: one process, rank 0 of 1
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from expgpu.ranks import local, mpi, slurm, torchrun
from expgpu.ranks.info import RankInfo

__all__ = ["RankInfo", "detect", "ORDER", "single"]

ORDER = (local, torchrun, slurm, mpi)  # first match wins; single() when none does


def single() -> RankInfo:
    # Port 0: no process group partner to meet, so no port is reserved; pick a free one if ever needed.
    return RankInfo(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=0,
        source="single",
    )


def detect(env: Mapping[str, str] | None = None) -> RankInfo:
    """Where this process sits in its job; ``env`` defaults to os.environ."""
    env = os.environ if env is None else env
    for source in ORDER:
        info = source.detect(env)
        if info is not None:
            return info
    return single()
