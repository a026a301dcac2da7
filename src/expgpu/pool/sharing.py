"""hydra.launcher.jobs_per_gpu=N: N of a sweep's jobs on each GPU at once, for models too small to keep a GPU
busy alone (a search's trials of an MLP on an 80 GB card). Each GPU counts as N shares; a job takes one share of
each GPU it needs, never two of one (a 2-GPU job's ranks are on two cards, each shared with other jobs).

The pool hands out shares as it hands out GPUs (expgpu.pool.starts): a Share is the GPU itself (its index, its
UUID: the job's CUDA_VISIBLE_DEVICES is the card's) with which of its N shares it is. Shares are offered share 0
of every GPU first, then share 1, ...: jobs spread over the cards before they double up. Leases
(expgpu.pool.leases): a share holds the GPU's lock file shared (flock LOCK_SH) and its share's own file
exclusive, so a sweep without sharing (which takes the GPU's lock exclusive) waits for every sharing job on
it, and sweeps that share a card with each other keep to N jobs on it by the share files they hold.

The jobs of one GPU share its memory as they use it (each allocates what it needs, no more; PyTorch's caching
allocator keeps what it freed for its own next use): N jobs must fit in its memory together, or one fails
with CUDA out of memory, as it would beside any other process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from expgpu.gpus.inventory import Gpu


@dataclass(frozen=True)
class Share(Gpu):
    share: int = 0    # which of the GPU's shares, 0 .. of - 1
    of: int = 1       # hydra.launcher.jobs_per_gpu


def shares(gpus: Sequence[Gpu], n: int) -> list:
    """The pool's GPUs as n shares each, spread first; the GPUs themselves when n is 1."""
    if n == 1:
        return list(gpus)
    return [Share(**_fields(g), share=k, of=n) for k in range(n) for g in gpus]


def is_share(gpu: Any) -> bool:
    return isinstance(gpu, Share) and gpu.of > 1


def card(gpu: Gpu) -> Gpu:
    """The GPU a share is of."""
    return Gpu(**_fields(gpu))


def _fields(gpu: Gpu) -> dict:
    return {f.name: getattr(gpu, f.name) for f in dataclasses.fields(Gpu)}


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
    text = "GPU " + ",".join(str(g.index) for g in gpus)
    if gpus and is_share(gpus[0]):
        text += f" (share{'s' if len(gpus) > 1 else ''} {','.join(str(g.share + 1) for g in gpus)} of {gpus[0].of})"
    return text
