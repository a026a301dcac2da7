"""`launch.wrap=fsdp`: run.wrap(module) shards it with FSDP2 (torch.distributed.fsdp.fully_shard).

Each unit (`launch.fsdp.units`: module class names; by default the module's direct children that
hold parameters) becomes one FSDP group, then the root takes what is left. fully_shard works in
place: the module keeps its class (a subclass of it, FSDP<YourClass>), its attributes, methods
and state_dict names, so what the user gets back is their own module, as with Wrapped for DDP;
its parameters are DTensors, each rank holding 1/world of every one.

Options (launch.fsdp): reshard_after_forward (the units'; the root keeps its gathered parameters
from forward to backward, fully_shard's own default for the root), cpu_offload
(CPUOffloadPolicy: the shards, their gradients and the optimizer's state in host memory), and
the run's task.precision: bf16 (or 16) keeps the shards in float32 and computes in the low
precision, with gradients reduced in float32 (MixedPrecisionPolicy).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

from expgpu.errors import UserError


def shard(model, device, world_size: int, settings: dict, precision: str):
    """`model` (on `device`) sharded over the world's ranks; the same module, now an FSDPModule."""
    units = unit_modules(model, settings.get("units"))
    if world_size == 1:
        return model   # nothing to shard across: as DDP at one rank, the module itself
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    _same_start(model)
    mesh = init_device_mesh(device.type, (world_size,))
    low = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision)
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None),
        # pinned host memory needs CUDA; on a CPU run the shards are in host memory anyway
        "offload_policy": (CPUOffloadPolicy(pin_memory=device.type == "cuda") if settings.get("cpu_offload")
                           else OffloadPolicy()),
    }
    for unit in units:   # bottom-up: a unit's parameters are its group's, not an enclosing one's
        fully_shard(unit, reshard_after_forward=bool(settings.get("reshard_after_forward", True)), **options)
    fully_shard(model, **options)
    return model


def unit_modules(model, names: Iterable[str] | None) -> list:
    """The submodules to shard as units, deepest first (fully_shard's bottom-up order)."""
    if names is None:   # the direct children that hold parameters of their own
        return [child for child in model.children() if any(True for _ in child.parameters())][::-1]
    names = list(names)
    classes = sorted({type(m).__name__ for m in model.modules()})
    missing = [n for n in names if n not in classes]
    if missing:
        raise UserError(f"launch.fsdp.units={names}: the model has no {', '.join(missing)}; its module classes "
                        f"are {', '.join(classes)}")
    return [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in names]


def _same_start(model) -> None:
    """Every rank's module as rank 0's, before sharding keeps each rank's own slice of it: DDP
    broadcasts rank 0's state when it wraps, fully_shard does not (ranks may seed differently)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def held_bytes(model, optimizer) -> tuple[int, int]:
    """The bytes this rank holds of `model`'s parameters and of `optimizer`'s state: its local
    shards under fsdp (a DTensor's to_local()), the whole tensors otherwise."""
    def local(tensors) -> int:
        total = 0
        for t in tensors:
            if hasattr(t, "numel") and hasattr(t, "element_size"):
                t = t.to_local() if hasattr(t, "to_local") else t
                total += t.numel() * t.element_size()
        return total

    return local(model.parameters()), local(v for s in optimizer.state.values() for v in s.values())


def no_sync(module):
    """FSDP2's no_sync: micro-steps keep their gradients unsharded and unreduced until the last
    one, which reduce-scatters the sum (set_requires_gradient_sync, as torchtitan's accumulation)."""
    @contextlib.contextmanager
    def skipped():
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    return skipped()
