"""Speed-proportional batches: each rank's share of a fixed global batch, and the loss weight
that keeps the gradient equal to the uniform one (docs/proportional-batches.md has the maths).

DDP makes every step wait for the slowest rank. With `data.shard=proportional` rank r takes
b_r examples of each global batch of B = task.batch_size x W, b_r proportional to its speed,
so all ranks finish their part at about the same time. `data.shard=auto` measures the ranks'
own compute time over the first `data.auto_steps` steps and rebalances once.

Global batch k of epoch e is always positions [kB, (k+1)B) of the permutation that
torch's DistributedSampler draws for (seed + e): every mode trains on the same global batches,
in the same order, and only who computes which part of them differs. Rank r takes the
contiguous slice [o_r, o_r + b_r) of each global batch (o_r = b_0 + ... + b_{r-1}), so a split
that changes between two steps, even mid-epoch, neither repeats nor skips an example.

Nothing here runs unless data.shard is not uniform or a faults.slow_* knob is set: the uniform
loop stays the plain DDP step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from expgpu.distributed.group import sync_device
from expgpu.errors import UserError
from expgpu.faults import Slowness, slowness_of

log = logging.getLogger("expgpu")

MODES = ("uniform", "proportional", "auto")


def split(total: int, speeds: Sequence[float]) -> list[int]:
    """Per-rank batch sizes proportional to `speeds`, summing to `total`, every one >= 1.

    Largest remainder: floor the quotas, then hand the leftover examples to the largest
    fractional parts (ties to the lower rank). Pure and deterministic: every rank computes
    the same split from the same gathered speeds.
    """
    n = len(speeds)
    if n < 1 or total < n:
        raise ValueError(f"cannot split {total} examples over {n} ranks with every rank >= 1")
    for v in speeds:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"speeds must be finite numbers > 0, got {list(speeds)}")
    whole = float(sum(speeds))
    quotas = [total * v / whole for v in speeds]
    sizes = [max(1, math.floor(q)) for q in quotas]
    while sum(sizes) < total:
        r = max(range(n), key=lambda i: (quotas[i] - sizes[i], -i))
        sizes[r] += 1
    while sum(sizes) > total:   # only when some quota was below 1 and got lifted to 1
        r = max((i for i in range(n) if sizes[i] > 1), key=lambda i: (sizes[i] - quotas[i], -i))
        sizes[r] -= 1
    return sizes


def loss_weight(sizes: Sequence[int], rank: int, reduction: str = "mean") -> float:
    """The factor on rank `rank`'s loss that makes DDP's averaged gradient the gradient of the
    mean loss over the whole global batch: b_r * W / B for a mean-reduced loss, 1 for a sum."""
    if reduction == "sum":
        return 1.0
    return sizes[rank] * len(sizes) / sum(sizes)


def loss_reduction(loss_fn: Any) -> str:
    """'mean' or 'sum': how the task's loss reduces a batch. torch.nn losses say so in
    `.reduction` (a functools.partial in its keywords); any other callable is taken to be a
    mean, as the built-in losses are. A sum-reducing callable says `reduction = "sum"`."""
    red = getattr(loss_fn, "reduction", None)
    if red is None:
        red = (getattr(loss_fn, "keywords", None) or {}).get("reduction", "mean")
    if red not in ("mean", "sum"):
        raise UserError(f"task.loss has reduction={red!r}: unequal per-rank batches need a scalar loss; "
                        "allowed: reduction 'mean' or 'sum' (or data.shard=uniform)")
    return red


def batches_per_epoch(n: int, global_batch: int) -> int:
    return n // global_batch


class ShareBatchSampler:
    """Rank `rank`'s slice of every global batch of one epoch, from global batch `start` on.

    Yields lists of dataset indices (a DataLoader batch_sampler). The tail of n mod B examples
    that fills no global batch is left out of the epoch, as DataLoader(drop_last=True) does;
    it is a different tail each epoch because the permutation is. `sizes` may change between
    two iterations (a rebalance): the next iteration slices by the new split.
    """

    def __init__(self, n: int, sizes: Sequence[int], rank: int, seed: int, epoch: int = 0, start: int = 0):
        self.n, self.sizes, self.rank = n, list(sizes), rank
        self.seed, self.epoch, self.start = seed, epoch, start
        self.keyed = False   # yield (epoch, index) keys, for expgpu.train.batches.SeededFetch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, batches: int) -> None:
        self.start = batches

    def __len__(self) -> int:
        return max(0, batches_per_epoch(self.n, sum(self.sizes)) - self.start)

    def __iter__(self):
        import torch

        start, self.start = self.start, 0
        # The very permutation DistributedSampler(shuffle=True, seed) draws for this epoch.
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        b, size = sum(self.sizes), self.sizes[self.rank]
        lo = sum(self.sizes[:self.rank])
        for k in range(start, batches_per_epoch(self.n, b)):
            batch = perm[k * b + lo:k * b + lo + size]
            yield [(self.epoch, i) for i in batch] if self.keyed else batch


@dataclass
class Split:
    """The split in use: what a checkpoint records so a resumed run continues with it."""
    mode: str
    sizes: list[int]
    measured: bool = False            # auto: the rebalance has happened
    speeds: list[float] | None = None  # examples/s (auto) or weights/scores behind `sizes`

    def to_dict(self) -> dict:
        return {"mode": self.mode, "sizes": list(self.sizes), "measured": self.measured,
                "speeds": None if self.speeds is None else [float(s) for s in self.speeds]}

    @classmethod
    def from_dict(cls, d: dict) -> Split:
        return cls(d["mode"], [int(s) for s in d["sizes"]], bool(d.get("measured")), d.get("speeds"))

    def describe(self) -> str:
        return ", ".join(f"rank {r} -> {b}" for r, b in enumerate(self.sizes))


def initial_split(mode: str, batch_size: int, world_size: int, weights: Sequence[float] | None,
                  speeds: Sequence[float | None]) -> Split:
    """The split a run starts with. `speeds` are every rank's GPU score (None for a CPU rank),
    gathered, so every rank decides alike.

    proportional: data.weights when given, else the GPU scores; a CPU rank without weights
    is an error (its speed is unknown: use auto). auto: starts from the same when known, else
    uniform, and measures.
    """
    total = batch_size * world_size
    uniform = Split(mode, [batch_size] * world_size)
    if mode == "uniform":
        return uniform
    if weights is not None:
        if len(weights) != world_size:
            raise UserError(f"data.weights={list(weights)} has {len(weights)} entries but the run has "
                            f"{world_size} ranks; give one weight per rank (rank 0 first)")
        known = [float(w) for w in weights]
    elif all(s is not None and s > 0 for s in speeds):
        known = [float(s) for s in speeds]
    elif mode == "auto":
        return uniform
    else:
        cpu = [r for r, s in enumerate(speeds) if s is None or s <= 0]
        raise UserError(f"data.shard=proportional: rank {cpu[0]} has no GPU score to size its batch by "
                        f"(it runs on the CPU or its GPU's score is unknown); give data.weights=[...] "
                        f"({world_size} numbers, one per rank) or use data.shard=auto to measure")
    return Split(mode, split(total, known), speeds=known)


def gpu_speed(scores: dict, gpus: Sequence[Any], ranked: bool) -> float | None:
    """A rank's speed from its GPU(s): the ranked score when the plan is ranked, else each GPU's
    own score (measured or simulated), else SM count x clock. None for a CPU rank."""
    if not gpus:
        return None
    total = 0.0
    for g in gpus:
        s = scores.get(g.index) if ranked else None
        if s is None:
            s = g.score if g.score is not None else float(g.sm_count * g.clock_mhz)
        total += s
    return total if total > 0 else None


@dataclass
class LocalStep:
    """The forward/backward of one rank when batches are unequal, measured or slowed.

    Outside the measurement window this is the DDP step with the loss scaled by `weight`. In
    the window (auto) the backward runs under DDP's no_sync, so its wall time is this rank's
    own compute and not the wait for the slowest rank; the gradients are then averaged by
    hand, which is what DDP would have done. When accumulating, that is after every micro-batch:
    what was averaged before is the same on every rank and stays so, the mean being linear.
    """
    split: Split
    rank: int
    world_size: int
    reduction: str = "mean"
    measure_steps: int = 0             # > 0: measure this many forward/backwards, then rebalance
    slowness: Slowness | None = None
    device: Any = None
    times: list[float] = field(default_factory=list)
    steps: int = 0                     # forward/backwards done (micro-batches when accumulating)

    def __post_init__(self):
        self.weight = loss_weight(self.split.sizes, self.rank, self.reduction)

    @property
    def measuring(self) -> bool:
        return self.measure_steps > 0 and not self.split.measured

    @contextlib.contextmanager
    def step(self, model, batch: int):
        """Around one forward and backward of `batch` examples; yields the loss weight to apply."""
        measuring = self.measuring
        if measuring:
            sync_device(self.device)
            t0 = time.perf_counter()
        cpu0 = self.slowness.start() if self.slowness else 0.0
        with model.no_sync() if measuring else contextlib.nullcontext():
            yield self.weight
        if self.slowness:
            self.slowness.finish(cpu0, batch)
        if measuring:
            sync_device(self.device)
            self.times.append(time.perf_counter() - t0)
            average_gradients(model.parameters(), self.world_size)
        self.steps += 1

    def use(self, split: Split) -> None:
        """Continue with `split` (the one a resumed checkpoint recorded)."""
        self.split = split
        self.weight = loss_weight(split.sizes, self.rank, self.reduction)

    def rebalance_due(self) -> bool:
        return self.measuring and self.steps >= self.measure_steps

    def rebalance(self, gather: Callable[[Any], list]) -> Split:
        """Collective: every rank's examples/s -> the new split (same on every rank)."""
        # The first step pays for warm-up (allocator, kernels, caches): leave it out when we can.
        times = self.times[1:] if len(self.times) > 2 else self.times
        mine = self.split.sizes[self.rank] / max(statistics.median(times), 1e-9)
        speeds = [float(s) for s in gather(mine)]
        self.use(Split(self.split.mode, split(sum(self.split.sizes), speeds), measured=True, speeds=speeds))
        self.times.clear()
        if self.rank == 0:
            rates = ", ".join(f"{s:.0f}" for s in speeds)
            log.info("rebalanced split: %s (measured %s examples/s over %d batches)",
                     self.split.describe(), rates, self.steps)
        return self.split


def prepare(cfg: dict, world_size: int, rank: int, batch_size: int, loss_fn: Any, device: Any,
            speed: float | None, ddp: bool, gather: Callable[[Any], list], accumulate: int = 1) -> LocalStep | None:
    """This rank's LocalStep, or None when the plain uniform DDP step will do.

    `speed` is this rank's GPU score (None on a CPU rank); `gather` all-gathers one object per
    rank. Collective when data.shard is proportional or auto: every rank calls it. A resumed run
    then continues with the checkpoint's split (SplitState). With `accumulate` micro-batches per
    optimizer step every micro-batch is a global batch split alike, and data.auto_steps still
    counts optimizer steps.
    """
    data, faults = cfg["data"], cfg.get("faults") or {}
    mode = data.get("shard", "uniform")
    slow = slowness_of(faults, rank)
    if mode != "uniform" and world_size == 1:
        log.info("data.shard=%s with one rank: nothing to balance, the whole batch is this rank's", mode)
        mode = "uniform"
    if mode != "uniform" and not ddp:
        raise UserError(f"data.shard={mode} balances DDP ranks; it needs launch.wrap=ddp "
                        "(or data.shard=uniform)")
    if mode == "uniform":
        return None if slow is None else LocalStep(Split("uniform", [batch_size] * world_size), rank,
                                                    world_size, slowness=slow, device=device)
    reduction = loss_reduction(loss_fn)
    current = initial_split(mode, batch_size, world_size, data.get("weights"), gather(speed))
    if rank == 0:
        log.info("data.shard=%s: split %s (global batch %d)", mode, current.describe(), sum(current.sizes))
    steps = int(data.get("auto_steps") or 20) * accumulate if mode == "auto" else 0
    return LocalStep(current, rank, world_size, reduction, measure_steps=steps, slowness=slow, device=device)


class SplitState:
    """The split in use as run.track sees it: a resumed run continues with the checkpoint's split,
    and one trained with another data.shard is refused."""

    def __init__(self, mode: str, local: LocalStep | None, sampler: ShareBatchSampler | None,
                 batch_size: int, world_size: int):
        self.mode, self.local, self.sampler = mode, local, sampler
        self.uniform = Split("uniform", [batch_size] * world_size)

    @property
    def split(self) -> Split:
        return self.local.split if self.local is not None else self.uniform

    def state_dict(self) -> dict:
        return self.split.to_dict()

    def load_state_dict(self, state: dict) -> None:
        saved = Split.from_dict(state)
        if sum(saved.sizes) == sum(self.uniform.sizes) and len(saved.sizes) != len(self.uniform.sizes):
            # resumed on another world size (expgpu.checkpoint.world_change): the same global batches, split anew (one
            # rank runs uniform whatever data.shard says, so the mode may differ too)
            log.info("data.shard=%s: the checkpoint's split %s was for %d ranks; %d now start from %s", self.mode,
                     saved.sizes, len(saved.sizes), len(self.uniform.sizes), self.split.sizes)
            return
        if saved.mode != self.mode:
            raise UserError(f"data.shard={self.mode}: the checkpoint being resumed was trained with "
                            f"data.shard={saved.mode}; resume with the same data.shard or use a new run dir")
        if sum(saved.sizes) != sum(self.uniform.sizes) or len(saved.sizes) != len(self.uniform.sizes):
            raise UserError(f"the checkpoint's split {saved.sizes} does not fit task.batch_size="
                            f"{self.uniform.sizes[0]} x {len(self.uniform.sizes)} ranks; resume with the same settings")
        if self.local is not None and self.sampler is not None:
            self.local.use(saved)
            self.sampler.sizes = list(saved.sizes)


def average_gradients(parameters, world_size: int) -> None:
    """All-reduce the gradients as one flat tensor and divide by the world size (DDP's mean)."""
    import torch
    import torch.distributed as dist

    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:   # DDP would have reduced a zero gradient for it too
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
