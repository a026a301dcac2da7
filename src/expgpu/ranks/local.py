"""expgpu's own local spawn: the supervisor (expgpu.launch.spawn) tells each child who it is.

This source is checked FIRST, before torchrun and SLURM: these variables are written by expgpu
for exactly this child process, so they come from the innermost, most specific launcher. A child
spawned inside an srun step still inherits that step's SLURM_PROCID, SLURM_NTASKS, ... and those
describe the parent, not the child; they must not win.
"""

from __future__ import annotations

from collections.abc import Mapping

from expgpu import envvars
from expgpu.errors import env_int
from expgpu.ranks.info import RankInfo, build, env_port, env_str, is_set

# RankInfo field -> the variable the supervisor (expgpu.launch.spawn) sets for each child.
VARIABLES = {
    "rank": envvars.RANK,
    "local_rank": envvars.LOCAL_RANK,
    "world_size": envvars.WORLD_SIZE,
    "local_world_size": envvars.LOCAL_WORLD_SIZE,
    "node_rank": envvars.NODE_RANK,
    "master_addr": envvars.MASTER_ADDR,
    "master_port": envvars.MASTER_PORT,
}
_SIZES = ("world_size", "local_world_size")


def detect(env: Mapping[str, str]) -> RankInfo | None:
    if not is_set(env, VARIABLES["rank"]):
        return None
    fields = {
        field: env_int(env, var, minimum=int(field in _SIZES))
        for field, var in VARIABLES.items()
        if field not in ("master_addr", "master_port")
    }
    fields["master_addr"] = env_str(env, VARIABLES["master_addr"])
    fields["master_port"] = env_port(env, VARIABLES["master_port"])
    # One rank of one is a single process's run, as the user launched it: expgpu's spawn only
    # supervises it (the rank forked from a warm server, expgpu.launch.warm_server).
    return build("single" if fields["world_size"] == 1 else "local", VARIABLES, **fields)

