"""The DataLoaders a `Run` hands its loop: `run.loader`'s, and a script's own rebuilt as one.

Each takes this rank's share of every epoch (expgpu.train.batches.rank_loader) and resumes at its place. Its
batch size is per rank at the world size the run started with, so that a run resumed on another
number of ranks keeps its global batch (expgpu.checkpoint.world_change); a script's own DataLoader (shuffled
or in order, no sampler of its own) is rebuilt once with the same arguments.
"""

from __future__ import annotations

import logging
from typing import Any

from expgpu.checkpoint import world_change
from expgpu.errors import UserError
from expgpu.train.batches import positioner, rank_loader, rebuild_args

log = logging.getLogger("expgpu")


def check_loader_args(dataset, batch_size, kwargs: dict) -> None:
    """run.loader's arguments, or a one-line error naming the one that cannot be."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise UserError(f"run.loader: a {type(dataset).__name__} has no length to share out between ranks; "
                        "pass a map-style Dataset, or iterate your own loader with run.steps(your_loader, n)")
    for key in ("sampler", "batch_sampler", "shuffle", "generator"):
        if key in kwargs:
            raise UserError(f"run.loader: {key}= is expgpu's (the rank's share, resumable); build your own "
                            "DataLoader if you need your own sampler, and pass it to run.steps")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"run.loader: batch_size={batch_size!r} is not allowed: an integer >= 1")


class RankLoaders:
    """Builds a run's DataLoaders for one rank (`state`: the run's CheckpointState, which knows the world
    size the run started with)."""

    def __init__(self, state, cfg, device, world_size: int, rank: int, seed: int):
        self._state, self._cfg, self._device = state, cfg, device
        self._world_size, self._rank, self._seed = world_size, rank, seed
        self._rebuilt: dict[int, tuple] = {}   # id(a DataLoader of the script's) -> (it, its rank's rebuild)

    def build(self, dataset, batch_size: int, shuffle: bool, equal_shares: bool, drop_last: bool, **kwargs):
        kwargs.setdefault("num_workers", self._cfg.data.num_workers)
        kwargs.setdefault("pin_memory", self._device.type == "cuda")
        # batch_size is per rank at the world size the run started with (world_change): the global batch stays
        mine = self._state.rank_batch(batch_size, self._cfg.checkpoint.resume)
        loader = rank_loader(dataset, mine or batch_size, self._world_size, self._rank, self._seed, shuffle,
                             equal_shares, drop_last, **kwargs)
        if mine is None:   # an error only if it drives a resumed run.steps (check_feed, below)
            loader.sampler.unscaled = (batch_size, self._state.start_world)
        return loader

    def shared_out(self, loader):
        """A DataLoader the script built itself (shuffled or in order, no sampler of its own) as
        run.loader builds one: each rank its share of every epoch, a resume at its place."""
        given, rebuilt = self._rebuilt.get(id(loader), (None, None))
        if given is loader and rebuilt is not None:   # once per loader, not every epoch
            return rebuilt
        how = rebuild_args(loader)
        if how is None:
            return loader
        rebuilt = self.build(**how)
        self._rebuilt[id(loader)] = (loader, rebuilt)
        log.info("run.steps: the DataLoader given is shared out between the %d rank(s) as run.loader's "
                 "(%d batches an epoch on this rank)", self._world_size, len(rebuilt))
        return rebuilt


def global_batch(loader: Any) -> int | None:
    """The examples one step of all ranks takes from `loader`'s sampler (None when not expgpu's)."""
    sampler = positioner(loader) if loader is not None else None
    if sampler is None:
        return None
    if hasattr(sampler, "sizes"):   # proportional.ShareBatchSampler: its slices of one global batch
        return int(sum(sampler.sizes))
    size, ranks = getattr(sampler, "batch_size", None), getattr(sampler, "world_size", None)
    return size * ranks if isinstance(size, int) and isinstance(ranks, int) else None


def check_feed(state: dict, loader: Any, world: int, path: Any) -> None:
    """Before a resumed run's first step on another world size: its loader continues the same
    global sample sequence, or one line why not."""
    sampler = positioner(loader) if loader is not None else None
    unscaled = getattr(sampler, "unscaled", None)
    if unscaled is not None:
        batch_size, start = unscaled
        raise UserError(f"checkpoint {path} is of a run "
                        + world_change.indivisible("run.loader batch_size", batch_size, start, world))
    saved, now = state.get("global_batch"), global_batch(loader)
    if saved is not None and now is not None and saved != now:
        raise UserError(f"checkpoint {path} was written with a global batch of {saved} examples per step, this run "
                        f"takes {now} ({world} rank(s)); resume with the same batch size or use a new run dir")
    if loader is not None and sampler is None:
        log.warning("resumed on %d rank(s) from a checkpoint of %d: the loader given to run.steps is not "
                    "run.loader's, so its position (%s batches) is kept per rank, not as a global sample",
                    world, world_change.saved_world(state), world_change.where(state, 0, world)[1])
