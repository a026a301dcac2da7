"""RankInfo, the answer to "who am I?", and the checks every rank source shares."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from expgpu.errors import UserError

SOURCES = ("local", "torchrun", "slurm", "mpi", "single")


@dataclass(frozen=True)
class RankInfo:
    rank: int  # global rank, 0 .. world_size - 1
    local_rank: int  # rank among the processes of this job on this node
    world_size: int  # processes in the job, all nodes
    local_world_size: int  # processes of this job on this node
    node_rank: int  # index of this node among the job's nodes, 0 .. num_nodes - 1
    master_addr: str  # host of rank 0, where the rendezvous store listens
    # its TCP port; 0 = none chosen yet: fine for one process, and for expgpu's local spawn, where
    # rank 0 binds a free port and publishes it in the run dir (expgpu.distributed.group); an error elsewhere
    master_port: int
    source: str  # who told us: one of SOURCES
    # 0 = derive as ceil(world_size / local_world_size), which assumes every node runs as many
    # processes as this one; sources that know better (SLURM_NNODES, GROUP_WORLD_SIZE) pass it.
    num_nodes: int = 0
    # The global rank of each of this node's processes, by local rank: what the dry-run table and
    # plan.json label a node's GPUs with. SLURM passes its own (SLURM_GTIDS): cyclic and plane layouts
    # interleave nodes. Not passed: rank - local_rank + (0 .. local_world_size - 1), right where a
    # launcher numbers a node's processes contiguously (torchrun, expgpu's spawn, mpirun's default);
    # stays () = unknown where that block does not fit in the world (torchrun --virtual-local-rank
    # gives every worker LOCAL_RANK=0). None for a rank of this node that cannot be known.
    ranks_on_node: tuple[int | None, ...] = ()

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"RankInfo.source={self.source!r} must be one of {', '.join(SOURCES)}")
        if self.num_nodes == 0 and self.local_world_size > 0:
            object.__setattr__(self, "num_nodes", -(-self.world_size // self.local_world_size))
        check(dataclasses.asdict(self), {})
        first = self.rank - self.local_rank
        if not self.ranks_on_node and first >= 0 and first + self.local_world_size <= self.world_size:
            object.__setattr__(self, "ranks_on_node", tuple(range(first, first + self.local_world_size)))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check(fields: Mapping[str, Any], names: Mapping[str, str]) -> None:
    """Raise UserError on fields that cannot describe a real job.

    ``names`` maps a field to the environment variable it was read from, so the message names
    what the user can fix; a field missing from it is called by its own name.
    """

    def name(field: str) -> str:
        return names.get(field, field)

    def fail(field: str, rule: str) -> None:
        value = fields[field]
        shown = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value
        raise UserError(f"{name(field)}='{shown}' {rule}")

    for field in ("world_size", "local_world_size"):
        if fields[field] < 1:
            fail(field, "must be >= 1")
    for field in ("rank", "local_rank", "node_rank"):
        if fields[field] < 0:
            fail(field, "must be >= 0")
    for small, big in (("rank", "world_size"), ("local_rank", "local_world_size"), ("node_rank", "num_nodes")):
        if fields.get(big) and fields[small] >= fields[big]:
            fail(small, f"must be < {name(big)}={fields[big]}")
    if fields["local_world_size"] > fields["world_size"]:
        fail("local_world_size", f"must be <= {name('world_size')}={fields['world_size']}")
    addr = fields["master_addr"]
    if not addr or any(c.isspace() for c in addr):
        fail("master_addr", "must be a host name or IP address without spaces")
    port = fields["master_port"]
    if not 0 <= port <= 65535 or (port == 0 and fields["world_size"] > 1 and fields["source"] != "local"):
        fail("master_port", "must be a TCP port in 1..65535")
    _check_ranks_on_node(fields, name, fail)


def _check_ranks_on_node(fields: Mapping[str, Any], name, fail) -> None:
    given = tuple(fields.get("ranks_on_node") or ())
    if not given:
        return
    rank, local_rank, world = fields["rank"], fields["local_rank"], fields["world_size"]
    if len(given) != fields["local_world_size"]:
        fail("ranks_on_node", f"lists {len(given)} ranks but this node has "
                              f"{name('local_world_size')}={fields['local_world_size']}")
    known = [r for r in given if r is not None]   # None: a rank the source cannot tell (SLURM's disagree)
    if len(set(known)) != len(known) or not all(0 <= r < world for r in known):
        fail("ranks_on_node", f"must list distinct ranks below {name('world_size')}={world}")
    if given[local_rank] != rank:
        fail("ranks_on_node", f"gives local rank {local_rank} the rank {given[local_rank]} but {name('rank')}={rank}")


def build(source: str, names: Mapping[str, str], **fields: Any) -> RankInfo:
    """Check ``fields`` naming the variables in ``names``, then make the RankInfo."""
    check({"num_nodes": 0, "source": source, **fields}, names)
    return RankInfo(source=source, **fields)


def is_set(env: Mapping[str, str], name: str) -> bool:
    # An empty value is how shells and configs usually "unset" a variable; treat it so.
    return bool(env.get(name, "").strip())


def env_str(env: Mapping[str, str], name: str) -> str:
    if not is_set(env, name):
        raise UserError(f"environment variable {name} is not set (or empty)")
    return env[name].strip()


def env_port(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A port variable, or ``default`` when unset; check() rejects 0 for a world of several."""
    if not is_set(env, name) and default is not None:
        return default
    raw = env_str(env, name)
    if not re.fullmatch(r"[0-9]{1,5}", raw) or int(raw) > 65535:
        raise UserError(f"{name}={env[name]!r} must be a TCP port in 1..65535")
    return int(raw)
