"""Make a NodePlan real in this process: the one step of expgpu.gpus that touches CUDA (through torch,
imported lazily, and only after CUDA_VISIBLE_DEVICES is set).

Isolation "visible_devices" hides every other GPU from this process: the rank's GPU becomes cuda:0,
so code that assumes cuda:0 (and NCCL) cannot touch a neighbour's card. It must run before CUDA
initializes, because CUDA reads the mask once. "set_device" keeps the mask and selects the GPU by
ordinal, for processes whose CUDA is already running.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, MutableMapping, Sequence

from expgpu.errors import UserError
from expgpu.gpus.inventory import Gpu
from expgpu.gpus.mask import gpu_env
from expgpu.gpus.strategies import NodePlan

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
ISOLATIONS = ("visible_devices", "set_device")


def set_device_ordinal(gpu: Gpu, visible: Sequence[Gpu]) -> int:
    """The CUDA ordinal of `gpu` when the inherited mask is kept: its position in `visible`, the
    inventory after that mask, in the mask's order (CUDA numbers masked GPUs in mask order)."""
    for ordinal, g in enumerate(visible):
        if g.index == gpu.index:
            return ordinal
    raise UserError(f"GPU {gpu.index} is not among the GPUs this process sees "
                    f"({', '.join(str(g.index) for g in visible) or 'none'}); plan from this process's inventory")


def cuda_initialized() -> bool:
    """True if torch is imported and has started CUDA; never imports torch or starts CUDA itself."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def apply(plan: NodePlan, local_rank: int, isolation: str = "visible_devices",
          env: MutableMapping[str, str] = os.environ) -> torch.device:
    """Give this process its planned GPU(s); returns the torch.device the task should use.

    visible_devices: call before anything in torch.cuda (even is_available(), which starts the CUDA
    driver and fixes the mask). A rank with several GPUs sees them as cuda:0..k-1; set_device selects
    only the first one.
    """
    if isolation not in ISOLATIONS:
        raise UserError(f"launch.isolation={isolation!r}: unknown; allowed: {', '.join(ISOLATIONS)}")
    gpus = plan.gpus_of(local_rank)
    if not gpus:
        import torch
        return torch.device("cpu")
    order = env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if order != "PCI_BUS_ID":  # never overwrite the user's choice; name GPUs by UUID instead
        log.warning("CUDA_DEVICE_ORDER=%s kept as set; expgpu selects GPUs by UUID, but CUDA ordinals in "
                    "your logs will not match nvidia-smi (unset it or use PCI_BUS_ID)", order)
    if isolation == "visible_devices":
        mask = gpu_env(gpus, order)["CUDA_VISIBLE_DEVICES"]
        inherited = env.get("CUDA_VISIBLE_DEVICES")
        if cuda_initialized() and inherited != mask:   # CUDA has read the mask: changing it does nothing
            raise UserError("CUDA was initialized before expgpu could isolate this rank's GPU with "
                            "CUDA_VISIBLE_DEVICES; use launch.isolation=set_device or touch CUDA only after setup")
        if inherited is not None and inherited != mask:  # narrowed from it: the plan saw only its GPUs
            log.info("local rank %d: narrowing inherited CUDA_VISIBLE_DEVICES=%s to %s", local_rank, inherited, mask)
        env["CUDA_VISIBLE_DEVICES"] = mask
        import torch  # only now: nothing may read the mask before it is set
        if env is os.environ:   # another mapping is not this process's mask (a child's env, a test)
            _check_mask_took_effect(torch, len(gpus))
        return torch.device("cuda", 0)
    import torch
    if not torch.cuda.is_available():
        raise UserError(f"launch.isolation=set_device: local rank {local_rank} was planned GPU {gpus[0].index} "
                        "but this process sees no CUDA device (a simulated inventory trains on the CPU)")
    ordinal = _by_uuid(torch, gpus[0], set_device_ordinal(gpus[0], plan.visible))
    torch.cuda.set_device(ordinal)
    return torch.device("cuda", ordinal)


def _check_mask_took_effect(torch, wanted: int) -> None:
    """torch.cuda.is_available() runs cuInit, which reads the mask once, yet leaves is_initialized()
    False: a mask set after it is silently ignored and cuda:0 is someone else's GPU. The CUDA runtime's
    own count (not torch's NVML-based device_count) shows it; counting now is harmless, the mask is set."""
    count = getattr(torch._C, "_cuda_getDeviceCount", lambda: 0)()   # absent in CPU-only builds
    if count > wanted:
        raise UserError(f"CUDA started before expgpu set CUDA_VISIBLE_DEVICES (it sees {count} GPUs, not "
                        f"{wanted}): call nothing in torch.cuda before setup, or use launch.isolation=set_device")


def _by_uuid(torch, gpu: Gpu, guess: int) -> int:
    """CUDA reads CUDA_DEVICE_ORDER once, when it starts: if it started before expgpu could ask for
    PCI_BUS_ID (the usual reason for set_device), ordinals may follow FASTEST_FIRST. The UUID is the
    same in NVML and CUDA whatever the order, so trust it where torch reports it."""
    try:
        uuids = [str(torch.cuda.get_device_properties(i).uuid).lower() for i in range(torch.cuda.device_count())]
    except (AttributeError, RuntimeError):   # an older torch without .uuid
        return guess
    want = gpu.uuid.lower().removeprefix("gpu-")
    return uuids.index(want) if want in uuids else guess
