"""The batches `run.steps` hands out: this rank's share of every epoch, and where to resume.

`RankSampler` (what `run.loader` puts in its DataLoader) gives rank r the indices perm[r::W] of
the permutation torch's DistributedSampler draws for (seed + epoch), so the W ranks together see
each example once per epoch. It can start an epoch at a batch position, which is what makes a
resumed run see exactly the batches the uninterrupted one would have seen.

It also owns the DataLoader's generator: creating a DataLoader iterator draws a seed for its
workers, from the global torch RNG unless the loader has a generator of its own. That draw would
make a resumed run's dropout masks and noise differ from the uninterrupted run's (the RNG is
restored, then the iterator draws from it), so each epoch's draw comes from a generator seeded
by (seed, epoch, rank) instead.

With DataLoader workers a dataset that draws random numbers (augmentation) draws them in the
workers, whose RNGs the checkpoint cannot hold; `SeededFetch` seeds them before each batch from
the batch's place, so a resumed run's workers draw what the uninterrupted run's drew.

`Feed` walks a loader through epochs for `run.steps`: the loader from `run.loader` (exact resume),
any other iterable (a resumed epoch skips the batches already seen), or None (no data).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

from expgpu.distributed import rng
from expgpu.errors import UserError


class RankSampler:
    """Rank `rank`'s indices of an epoch, optionally from a batch position on.

    drop_last=True: the permutation is cut to a multiple of the world size (every rank gets
    as many examples); drop_last=False: nothing is cut or padded, every example is seen exactly
    once per epoch (ranks may differ by one example: what an evaluation wants).
    """

    def __init__(self, n: int, world_size: int, rank: int, shuffle: bool, seed: int, drop_last: bool,
                 batch_size: int):
        import torch

        self.n, self.world_size, self.rank = n, world_size, rank
        self.shuffle, self.seed, self.drop_last, self.batch_size = shuffle, seed, drop_last, batch_size
        # Where the next iteration starts, as an offset into the epoch's permutation (then 0 again):
        # global, so that a run resumed on another number of ranks continues at the same sample.
        self.start = 0
        self.keyed = False   # yield (epoch, index) keys, for SeededFetch
        self.unscaled: tuple[int, int] | None = None   # (global batch, world): see world_change.rank_batch
        self.generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        # (seed, epoch, rank) -> the DataLoader's worker seeds for this epoch, on every run alike
        self.generator.manual_seed((self.seed * 1_000_003 + epoch) * 1_009 + self.rank)

    def skip(self, batches: int) -> None:
        # Batch k of every rank is positions [kWb, (k+1)Wb) of the permutation, whatever W is,
        # as long as W x b (the global batch) is the same: so a position in batches is global too.
        self.start = batches * self.batch_size * self.world_size

    def _indices(self) -> list[int]:
        if self.shuffle:
            import torch

            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        return order[:self._cut()][self.start:][self.rank::self.world_size]

    def _cut(self) -> int:
        return self.n - self.n % self.world_size if self.drop_last else self.n

    def __iter__(self) -> Iterator[int]:
        indices = self._indices()
        self.start = 0
        return iter([(self.epoch, i) for i in indices] if self.keyed else indices)

    def __len__(self) -> int:
        return len(range(self.rank, max(0, self._cut() - self.start), self.world_size))


class SeededFetch:
    """`dataset` as run.loader's workers fetch it: each batch's random draws seeded by its place.

    A DataLoader worker seeds its RNGs once, when it starts, and then a dataset that draws random
    numbers draws them in the order the worker fetches. A run resumed mid-epoch starts fresh
    workers at its batch position, so their draws, and the training after them, would differ from
    the uninterrupted run's. Seeding Python's, NumPy's and torch's RNG before each batch from
    (task seed, epoch, the batch's first index) makes a batch's draws depend on the batch alone:
    the same in every run, whatever the worker count or where the run resumed. Used only with
    workers: without them the dataset draws from the main process's RNG, which the checkpoint
    holds. The sampler hands out (epoch, index) keys (`keyed`); the dataset gets plain indices.
    """

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:   # loader.dataset[i] from user code: the dataset's own
        return self.dataset[index]

    def __getitems__(self, keys: list) -> list:   # what a DataLoader worker calls for a batch
        epoch, first = keys[0]
        digest = hashlib.blake2b(f"{self.seed}/{epoch}/{first}".encode(), digest_size=8).digest()
        rng.seed_cpu(int.from_bytes(digest, "little") >> 1)
        indices = [i for _, i in keys]
        fetch = getattr(self.dataset, "__getitems__", None)
        return fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]

    def __getattr__(self, name: str) -> Any:   # loader.dataset.classes and the like
        if name in ("dataset", "seed") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def rank_loader(dataset: Any, batch_size: int, world_size: int, rank: int, seed: int, shuffle: bool,
                equal_shares: bool, drop_last: bool, **kwargs):
    """Rank `rank`'s DataLoader over `dataset` (run.loader's): `equal_shares` cuts each epoch to a
    multiple of the world size (RankSampler's drop_last), `drop_last` drops a last short batch."""
    from torch.utils.data import DataLoader

    sampler = RankSampler(len(dataset), world_size, rank, shuffle, seed, equal_shares, batch_size)
    if kwargs.get("num_workers"):   # workers' random draws (augmentation) seeded per batch: exact resume
        dataset, sampler.keyed = SeededFetch(dataset, seed), True
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                      generator=sampler.generator, **kwargs)


def rebuild_args(loader: Any) -> dict | None:
    """rank_loader's arguments for a DataLoader a script built itself, shuffled or in order and with
    no sampler of its own (None for anything else): as given, every rank would train on all of it,
    and a shuffled one resumed mid-epoch would draw another order from the global RNG. Its share is
    cut equal (DDP needs as many steps on every rank); its own drop_last decides its last batch."""
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

    sampler = getattr(loader, "sampler", None)
    plain = type(sampler) is SequentialSampler or (type(sampler) is RandomSampler and not sampler.replacement
                                                   and sampler.num_samples == len(sampler.data_source))
    if type(loader) is not DataLoader or not plain or loader.batch_size is None:
        return None
    kwargs = {k: getattr(loader, k) for k in ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn")}
    if loader.num_workers:
        kwargs.update({k: getattr(loader, k) for k in ("prefetch_factor", "persistent_workers",
                                                       "multiprocessing_context")})
    return dict(dataset=loader.dataset, batch_size=loader.batch_size, shuffle=type(sampler) is RandomSampler,
                equal_shares=True, drop_last=loader.drop_last, **kwargs)


def positioner(loader: Any):
    """The sampler of `loader` that can start an epoch at a batch position, if it has one."""
    for attr in ("batch_sampler", "sampler"):
        s = getattr(loader, attr, None)
        if s is not None and hasattr(s, "skip") and hasattr(s, "set_epoch"):
            return s
    return None


def to_device(batch: Any, device) -> Any:
    """Tensors inside tuples, lists and dicts moved to `device`; anything else as it is."""
    if hasattr(batch, "to") and hasattr(batch, "device"):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    return batch


# What Feed.next gives at the end of the loader under run.epochs, where an epoch ends run.steps.
END_OF_EPOCH = object()


class Feed:
    """Batches for run.steps, epoch after epoch (or one, under run.epochs: `one_epoch`), with the
    (epoch, position) a checkpoint keeps."""

    def __init__(self, loader: Any, device, accumulate: int, one_epoch: bool = False):
        self.loader, self.device, self.accumulate, self.one_epoch = loader, device, accumulate, one_epoch
        self.move = device.type != "cpu"   # a DataLoader's batches are on the CPU already
        self.sampler = positioner(loader) if loader is not None else None
        self.epoch = 0
        self.position = 0          # batches of this epoch already handed out
        self._last_epoch = 0       # batches the epoch before this one gave
        self._it: Iterator | None = None

    def resume(self, epoch: int, position: int) -> None:
        self.epoch, self.position, self._it = epoch, position, None

    def restart(self) -> None:
        """The next batch comes from a new iterator at the same position (a changed split)."""
        self._it = None

    def next(self) -> Any:
        if self.loader is None:
            return None
        if self.accumulate == 1:
            return self._one()
        micro = [self._one() for _ in range(self.accumulate)]
        return END_OF_EPOCH if END_OF_EPOCH in micro else micro   # an epoch's last, partial step: dropped

    def batches_left(self) -> int | None:
        """Steps this epoch still holds, where the loader has a length."""
        try:
            return max(0, (len(self.loader) - self.position) // self.accumulate)
        except TypeError:
            return None

    def _one(self) -> Any:
        for _ in range(2):   # at most one new epoch per batch: an empty epoch is an error
            if self._it is None:
                self._it = self._start_epoch()
            try:
                batch = next(self._it)
            except StopIteration:
                if self.one_epoch:
                    return END_OF_EPOCH
                if self.position == 0:
                    raise UserError(self._empty()) from None
                self._last_epoch = self.position
                self.epoch, self.position, self._it = self.epoch + 1, 0, None
                continue
            self.position += 1
            return to_device(batch, self.device) if self.move else batch
        raise UserError(self._empty())

    def _start_epoch(self) -> Iterator:
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.skip(self.position)
            return iter(self.loader)
        set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)   # a DistributedSampler of the user's own
        it = iter(self.loader)
        for _ in range(self.position):   # no sampler to start from the position: skip what was seen
            next(it)
        return it

    def _empty(self) -> str:
        if self.epoch > 0 and iter(self.loader) is self.loader:   # a generator: read once, and read
            return (f"run.steps: the iterator it was given (a {type(self.loader).__name__}) ran out after "
                    f"{self._last_epoch} batch(es) and cannot start again: give run.steps an iterable that starts "
                    "again at each epoch (a list, a DataLoader, an IterableDataset), or fewer steps")
        size = getattr(self.loader, "batch_size", None)
        if isinstance(self.sampler, RankSampler):
            self.sampler.start = 0
            what = f"this rank's share of the dataset is {len(self.sampler)} examples"
        else:
            what = "it is empty"
        return f"run.steps: the loader gives no batch ({what}, batch_size={size}); lower the batch size"
