"""hydra.launcher.jobs_per_gpu=N: N of a sweep's jobs on each GPU at once, for models too small to keep a GPU
busy alone (a search's trials of an MLP on an 80 GB card). Each GPU counts as N shares; a job takes one share of
each GPU it needs, never two of one (a 2-GPU job's ranks are on two cards, each shared with other jobs).

The pool hands out shares as it hands out GPUs (expgpu.pool.starts): a Share is the GPU itself (its index, its
UUID: the job's CUDA_VISIBLE_DEVICES is the card's) with which of its N shares it is. Shares are offered share 0
of every GPU first, then share 1, ...: jobs spread over the cards before they double up. Leases
(expgpu.pool.leases): a share holds the GPU's lock file shared (flock LOCK_SH) and its share's own file
exclusive, so a sweep without sharing (which takes the GPU's lock exclusive) waits for every sharing job on
it, and sweeps that share a card with each other keep to the smallest N among them (each share file says its
holder's N).

Inside a SLURM allocation the pool's GPUs are its slots (expgpu.pool.allocation.Slot: a node's GPU), shared the
same way (SlotShare), with no lease: the jobs are forked by each node's warm process (expgpu.pool.node_servers),
which holds all the node's GPUs, so two jobs can be given one (an srun step of its own cannot: SLURM gives a
step's GPUs to no other step). A share gets its part of its GPU's CPUs.

The jobs of one GPU share its memory as they use it (each allocates what it needs, no more; PyTorch's caching
allocator keeps what it freed for its own next use): N jobs must fit in its memory together, or one fails
with CUDA out of memory, as it would beside any other process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from expgpu.errors import UserError
from expgpu.gpus.inventory import Gpu
from expgpu.pool.allocation import Slot


@dataclass(frozen=True)
class Share(Gpu):
    share: int = 0    # which of the GPU's shares, 0 .. of - 1
    of: int = 1       # hydra.launcher.jobs_per_gpu


@dataclass(frozen=True)
class SlotShare(Slot):
    """A share of one of a SLURM allocation's GPUs."""
    share: int = 0
    of: int = 1


_SHARE_OF = {Gpu: Share, Slot: SlotShare}   # what a share of each kind of GPU is


def shares(gpus: Sequence[Any], n: int) -> list:
    """The pool's GPUs (this machine's, or an allocation's slots) as n shares each, spread first: share 0 of
    every GPU, then share 1, ...; the GPUs themselves when n is 1."""
    if n == 1:
        return list(gpus)
    return [_SHARE_OF[type(g)](**_fields(g), share=k, of=n) for k in range(n) for g in gpus]


def check(s, has_gpus: bool) -> None:
    """hydra.launcher.jobs_per_gpu against where the jobs run (s: expgpu.pool.settings.Settings): on GPUs."""
    if s.jobs_per_gpu > 1 and (not has_gpus or s.gpus_per_job == 0):
        where = ("hydra.launcher.gpus_per_job=0 puts every job on a CPU slot" if has_gpus
                 else "this pool has none (its jobs take CPU slots)")
        raise UserError(f"hydra.launcher.jobs_per_gpu={s.jobs_per_gpu} shares GPUs, and {where}: drop it, or give "
                        "more jobs at once with hydra.launcher.cpu_slots")


def check_in_allocation(s, has_gpus: bool) -> None:
    """The same inside a SLURM allocation, where the jobs must be forked by the nodes' warm processes, which
    hold all of a node's GPUs: an srun step of its own gets GPUs that SLURM gives to no other step."""
    check(s, has_gpus)
    if s.jobs_per_gpu > 1 and not s.warm_starts:
        raise UserError(f"hydra.launcher.jobs_per_gpu={s.jobs_per_gpu} is not allowed with "
                        "hydra.launcher.warm_starts=false inside a SLURM allocation: an srun step of its own "
                        "never shares its GPUs; true (the jobs forked by a warm process per node, which share "
                        "them), or jobs_per_gpu=1")


def is_share(gpu: Any) -> bool:
    return isinstance(gpu, (Share, SlotShare)) and gpu.of > 1


def card(gpu: Any) -> Any:
    """The GPU a share is of (a Gpu, or an allocation's Slot)."""
    return _base(gpu)(**_fields(gpu))


def _base(gpu: Any) -> type:
    return Slot if isinstance(gpu, Slot) else Gpu


def _fields(gpu: Any) -> dict:
    return {f.name: getattr(gpu, f.name) for f in dataclasses.fields(_base(gpu))}


def key(gpu: Any) -> tuple[int, int]:
    """What tells a pool's GPUs (or shares) apart: (index, share)."""
    return gpu.index, getattr(gpu, "share", 0)


def distinct(free: Sequence[tuple[int, int]], job: Any, need: int) -> tuple | None:
    """The scheduler's fit for shares: the first `need` free ones on as many different GPUs."""
    picked, cards = [], set()
    for k in free:
        if k[0] not in cards:
            picked.append(k)
            cards.add(k[0])
            if len(picked) == need:
                return tuple(picked)
    return None


def physical(gpus: Sequence[Any]) -> list:
    """The GPUs behind a pool's shares, each once (an allocation's are told apart by their node too)."""
    return list({(getattr(g, "node", None), g.index): g for g in gpus}.values())


def shown(gpus: Sequence[Any]) -> str:
    """'GPU 0,1', and which share of them when shared: 'GPU 0 (share 2 of 4)'."""
    return "GPU " + ",".join(str(g.index) for g in gpus) + which(gpus)


def which(gpus: Sequence[Any]) -> str:
    """' (share 2 of 4)', ' (shares 1,2 of 4)': which share of their GPUs a job's are; '' when not shared."""
    if not gpus or not is_share(gpus[0]):
        return ""
    return f" (share{'s' if len(gpus) > 1 else ''} {','.join(str(g.share + 1) for g in gpus)} of {gpus[0].of})"
