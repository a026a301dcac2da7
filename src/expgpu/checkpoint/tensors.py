"""Moving a checkpoint's state trees between devices: each tensor of a nested dict, list or tuple
(a namedtuple too) to the CPU before it travels between ranks, and back onto the device of the value
it replaces when a resume puts it back. No torch import: a tensor is anything with .to / .device."""

from __future__ import annotations

from typing import Any


def placed_like(loaded: Any, current: Any) -> Any:
    """`loaded` with each tensor on the device of its counterpart in `current` (nested alike)."""
    if hasattr(loaded, "to") and hasattr(current, "device"):
        return loaded.to(current.device)
    if isinstance(loaded, dict) and isinstance(current, dict):
        return {k: placed_like(v, current[k]) if k in current else v for k, v in loaded.items()}
    if isinstance(loaded, (list, tuple)) and isinstance(current, (list, tuple)) and len(loaded) == len(current):
        return rebuilt(loaded, [placed_like(a, b) for a, b in zip(loaded, current)])
    return loaded


def on_cpu(state: Any) -> Any:
    """Tensors moved to the CPU before they travel to rank 0: unpickled there, a tensor of another
    rank's GPU would be made on that GPU, by a process that must only touch its own."""
    if hasattr(state, "detach") and hasattr(state, "cpu"):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return rebuilt(state, [on_cpu(v) for v in state])
    return state


def rebuilt(seq: list | tuple, items: list) -> list | tuple:
    """A list or tuple of `items`, of `seq`'s own type (a namedtuple too)."""
    return type(seq)(*items) if hasattr(seq, "_fields") else type(seq)(items)
