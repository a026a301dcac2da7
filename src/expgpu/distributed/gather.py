"""run.gather and run.broadcast: what every rank computed, on every rank (an evaluation's predictions for a
metric that does not add up over ranks: AUC, mAP, a corpus BLEU), and one rank's object on every rank.

run.loader(drop_last=False) gives every example to exactly one rank, so the ranks' shares of an evaluation
differ by up to a batch: run.gather concatenates tensors whose first dimension differs by rank (padded for
torch's all_gather, which takes equal shapes, and trimmed after), so that every example is there once, as
accelerate's gather_for_metrics gives them after dropping its sampler's repeats. Evaluation code, not the
hot path: one small object collective for the shapes, one all_gather per tensor.
"""

from __future__ import annotations

from typing import Any

from expgpu.distributed.group import by_key, gather_objects
from expgpu.errors import UserError


def gather_value(value: Any, device, what: str = "value") -> Any:
    """Every rank's `value`, in rank order, on every rank (collective: every rank calls it, with the same
    kind of value). A tensor (or NumPy array) of one or more dimensions: concatenated along the first, which
    may differ by rank; a 0-d tensor: stacked, one entry per rank; a dict: each entry gathered (the same keys
    on every rank); anything else (a number, a list of strings): a list of each rank's. Out of place and
    detached; a tensor comes back on its own device."""
    if isinstance(value, dict):
        return by_key(value, lambda v, where: gather_value(v, device, where), what, "run.gather", "gathers")
    import torch

    if isinstance(value, torch.Tensor):
        return _gather_tensor(value, device, what)
    if getattr(value, "ndim", 0) > 0 and hasattr(value, "__array__"):   # a NumPy array: one back
        return _gather_tensor(torch.as_tensor(value), device, what).numpy()
    import torch.distributed as dist

    return gather_objects(value, dist.get_world_size() if dist.is_initialized() else 1)


def _gather_tensor(t, device, what: str):
    import torch
    import torch.distributed as dist

    mine = t.detach()
    mine = mine.reshape(1) if mine.ndim == 0 else mine
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine.clone()
    shapes = gather_objects((tuple(mine.shape), str(mine.dtype)), dist.get_world_size())
    for rank, (shape, dtype) in enumerate(shapes):
        if shape[1:] != shapes[0][0][1:] or dtype != shapes[0][1]:
            raise UserError(f"run.gather: {what} is a {dtype} tensor of shape {list(shape)} on rank {rank}, a "
                            f"{shapes[0][1]} one of shape {list(shapes[0][0])} on rank 0; every rank's must have "
                            "the same dtype and shape but for the first dimension")
    sizes = [shape[0] for shape, _ in shapes]
    visit = dist.get_backend() == "nccl" and mine.device.type != "cuda"
    work = mine.to(device) if visit else mine
    if max(sizes) > work.shape[0]:
        work = torch.cat([work, work.new_zeros((max(sizes) - work.shape[0], *work.shape[1:]))])
    work = work.contiguous()   # all_gather's buffers are dense, whatever the strides of the value given
    parts = [torch.empty_like(work) for _ in sizes]
    dist.all_gather(parts, work)
    joined = torch.cat([part[:n] for part, n in zip(parts, sizes)])
    return joined.to(t.device) if visit else joined


def broadcast_object(obj: Any, src: int, world_size: int) -> Any:
    """Rank `src`'s `obj` (anything picklable), on every rank (collective); the others' `obj` is not read."""
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world_size:
        raise UserError(f"run.broadcast(src={src!r}): the rank whose object every rank gets, 0 to {world_size - 1}")
    import torch.distributed as dist

    if not dist.is_initialized() or world_size == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
