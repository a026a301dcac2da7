"""The environment that shows a process only its GPU(s): CUDA_VISIBLE_DEVICES, set before CUDA starts."""

from __future__ import annotations

from typing import Sequence


def gpu_env(gpus: Sequence, order: str | None = None) -> dict[str, str]:
    """The environment that shows a process only `gpus` (expgpu Gpu objects; none: no GPU at all).

    NVML indices, readable in logs, with CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers GPUs as
    nvidia-smi does (CUDA's default, FASTEST_FIRST, reorders mixed cards). `order`: the
    CUDA_DEVICE_ORDER already in effect; another one than PCI_BUS_ID is kept (never overwritten) and
    the GPUs are named by UUID, which is right whatever the order.
    """
    if order not in (None, "", "PCI_BUS_ID"):
        return {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in gpus)}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(g.index) for g in gpus)}
