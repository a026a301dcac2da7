"""This node's GPUs: read from NVML (never a CUDA context), or simulated from config, then narrowed
by the CUDA_VISIBLE_DEVICES mask this process inherited (SLURM, a container, the user).

`Gpu.index` is the NVML index: PCI bus order, the number nvidia-smi prints. apply.py makes CUDA
count in the same order (CUDA_DEVICE_ORDER=PCI_BUS_ID).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from expgpu.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gpu:
    index: int            # NVML index (physical, PCI bus order = nvidia-smi order)
    name: str
    uuid: str
    pci_bus_id: str
    memory_total_mb: int
    memory_free_mb: int
    utilization: int      # percent, 0..100
    sm_count: int         # 0 if unknown
    clock_mhz: int        # max SM clock, 0 if unknown
    score: float | None = None   # a simulated GPU may carry a given score


# name -> (SM count, max SM clock MHz): defaults for simulated GPUs, and the SM count for NVML,
# which has no SM-count query for a whole GPU (nvmlDeviceGetAttributes answers for MIG handles only).
KNOWN_GPUS = {
    "B200": (148, 1965), "H200": (132, 1980), "H100 PCIe": (114, 1755), "H100": (132, 1980),
    "A100": (108, 1410), "A40": (84, 1740), "A30": (56, 1440), "A10G": (80, 1710), "A10": (72, 1695),
    "L40S": (142, 2520), "L40": (142, 2490), "L4": (58, 2040), "V100": (80, 1530), "P100": (56, 1480),
    "T4": (40, 1590), "RTX 4090": (128, 2520), "RTX 3090": (82, 1695), "RTX A6000": (84, 1800),
}
# Cards missing from the table: CUDA cores / cores per SM of the architecture (NVML_DEVICE_ARCH_*:
# Volta, Turing, Ampere, Ada, Hopper, Blackwell). Ampere is 64 only on A100/A30, which are in the table.
_CORES_PER_SM = {5: 64, 6: 64, 7: 128, 8: 128, 9: 128, 10: 128}
_SIM_KEYS = ("name", "memory_mb", "free_mb", "util", "sm_count", "clock_mhz", "score", "uuid", "processes")
_NO_GPUS = ("", "-1", "NoDevFiles")   # NoDevFiles: what older SLURM sets for a job without GPUs


def known_gpu(name: str) -> tuple[int, int]:
    """(sm_count, clock_mhz) for a card name such as 'NVIDIA A100-SXM4-80GB'; (0, 0) if unknown."""
    for key in sorted(KNOWN_GPUS, key=len, reverse=True):  # longest first: "A100" is not "A10"
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name, re.IGNORECASE):
            return KNOWN_GPUS[key]
    return (0, 0)


def inventory(simulate: Sequence[Mapping] | None = None, env: Mapping[str, str] | None = None) -> list[Gpu]:
    """This node's GPUs in CUDA order: NVML order, or the inherited mask's order. [] means cpu."""
    env = os.environ if env is None else env
    gpus = _simulated(simulate) if simulate is not None else _from_nvml()
    mask = env.get("CUDA_VISIBLE_DEVICES")
    return gpus if mask is None else parse_visible_devices(mask, gpus)


def _from_nvml() -> list[Gpu]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no libnvidia-ml, no driver: a CPU node, not an error
        return []
    try:
        def ask(call, *args, default=None):  # a field NVML refuses (old card, no permission) stays unknown
            try:
                return call(*args)
            except pynvml.NVMLError:
                return default

        gpus = []
        for i in range(ask(pynvml.nvmlDeviceGetCount, default=0)):
            h = ask(pynvml.nvmlDeviceGetHandleByIndex, i)
            if h is None:  # cgroup-hidden device: NVML counts it but may not open it
                continue
            name = ask(pynvml.nvmlDeviceGetName, h, default="")
            if ask(pynvml.nvmlDeviceGetMigMode, h, default=(0, 0))[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
                log.warning("GPU %d (%s) is in MIG mode: CUDA sees its slices, not the GPU; expgpu places "
                            "whole GPUs, so its CUDA ordinals may not match this plan", i, name)
            mem, util = ask(pynvml.nvmlDeviceGetMemoryInfo, h), ask(pynvml.nvmlDeviceGetUtilizationRates, h)
            bus = getattr(ask(pynvml.nvmlDeviceGetPciInfo, h), "busId", b"")
            sm_count, per_sm = known_gpu(name)[0], _CORES_PER_SM.get(ask(pynvml.nvmlDeviceGetArchitecture, h), 0)
            if not sm_count and per_sm:  # nvmlDeviceGetNumGpuCores counts CUDA cores, not SMs
                sm_count = ask(pynvml.nvmlDeviceGetNumGpuCores, h, default=0) // per_sm
            gpus.append(Gpu(i, name, ask(pynvml.nvmlDeviceGetUUID, h, default=""),
                            bus.decode() if isinstance(bus, bytes) else bus,
                            mem.total // 2**20 if mem else 0, mem.free // 2**20 if mem else 0,
                            util.gpu if util else 0, sm_count,
                            ask(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM, default=0)))
        return gpus
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _simulated(specs) -> list[Gpu]:
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise UserError(f"inventory.simulate={specs!r}: expected a list like [{{name: A100, memory_mb: 81920}}]")
    gpus: list[Gpu] = []
    for i, spec in enumerate(specs):
        where = f"inventory.simulate[{i}]"
        if not isinstance(spec, Mapping):
            raise UserError(f"{where}={spec!r}: expected a mapping with name and memory_mb")
        for key in spec:
            if key not in _SIM_KEYS:
                raise UserError(f"{where}.{key}: unknown key; allowed: {', '.join(_SIM_KEYS)}")
        for key in ("name", "memory_mb"):
            if key not in spec:
                raise UserError(f"{where}.{key}: missing; every simulated GPU needs name and memory_mb")
        name, uuid = spec["name"], spec.get("uuid", f"GPU-sim-{i}")
        for key, text in (("name", name), ("uuid", uuid)):
            if not isinstance(text, str) or not text.strip():
                raise UserError(f"{where}.{key}={text!r}: expected a non-empty string")
        if uuid in (g.uuid for g in gpus):
            raise UserError(f"{where}.uuid={uuid!r}: already used by another simulated GPU; give each its own")
        sm, clock = known_gpu(name)
        memory = _number(spec, "memory_mb", None, where, low=1)
        free = _number(spec, "free_mb", memory, where)
        if free > memory:
            raise UserError(f"{where}.free_mb={free}: more than memory_mb={memory}; allowed: 0..{memory}")
        score = spec.get("score")
        procs = spec.get("processes", [])   # PIDs that stand for its compute processes (expgpu.pool.busy)
        if not isinstance(procs, Sequence) or isinstance(procs, str) \
                or not all(isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 for pid in procs):
            raise UserError(f"{where}.processes={procs!r}: expected a list of process ids, e.g. [4242]")
        gpus.append(Gpu(i, name, uuid, f"00000000:{i + 1:02X}:00.0", memory, free,
                        _number(spec, "util", 0, where, high=100), _number(spec, "sm_count", sm, where),
                        _number(spec, "clock_mhz", clock, where),
                        None if score is None else _number(spec, "score", None, where, integer=False)))
    return gpus


def _number(spec, key, default, where, *, low=0, high=None, integer=True):
    value = spec.get(key, default)
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and value >= low and (high is None or value <= high) and (not integer or value == int(value)))
    if not ok:
        allowed = f"{low}..{high}" if high is not None else f"{'an integer' if integer else 'a number'} >= {low}"
        raise UserError(f"{where}.{key}={value!r}: not allowed; expected {allowed}")
    return int(value) if integer else float(value)


def parse_visible_devices(value: str, gpus: list[Gpu]) -> list[Gpu]:
    """Narrow `gpus` to an inherited CUDA_VISIBLE_DEVICES, in the mask's order (= CUDA ordinals).

    Entries are NVML indices or (prefixes of) UUIDs. "", "-1" and "NoDevFiles" mean no GPUs. A node
    whose NVML sees no GPU keeps none whatever the mask says (a stale mask on a CPU machine).
    """
    where = f"CUDA_VISIBLE_DEVICES={value!r}"
    if value.strip() in _NO_GPUS or not gpus:
        return []
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if any(e.upper().startswith("MIG-") for e in entries):
        raise UserError(f"{where}: MIG slices are not supported; expgpu places whole GPUs, so ask for whole GPUs")
    ints = [int(e) for e in entries if re.fullmatch(r"-?\d+", e)]
    indices = {g.index for g in gpus}
    # SLURM cgroups: NVML may see only the allocated GPUs, renumbered 0..k-1, while the mask keeps the
    # node-wide numbers ("2,3"). Both count in PCI bus order, so the k-th smallest entry is the k-th GPU.
    if (len(ints) == len(entries) == len(gpus) == len(set(ints))) and not indices & set(ints):
        return [gpus[sorted(ints).index(n)] for n in ints]
    allowed = f"indices {', '.join(str(i) for i in sorted(indices))} or GPU UUIDs (nvidia-smi -L)"
    chosen: list[Gpu] = []
    for e in entries:
        if re.fullmatch(r"-?\d+", e):
            found = [g for g in gpus if g.index == int(e)]
        else:
            uuid = e if e.upper().startswith("GPU-") else f"GPU-{e}"
            found = [g for g in gpus if g.uuid.lower() == uuid.lower()] or \
                [g for g in gpus if g.uuid.lower().startswith(uuid.lower())]
        if len(found) != 1:
            what = "matches no GPU on this node" if not found else f"matches {len(found)} GPUs (give more of the UUID)"
            raise UserError(f"{where}: entry {e!r} {what}; allowed: {allowed}")
        if found[0] in chosen:
            raise UserError(f"{where}: entry {e!r} names GPU {found[0].index} a second time; list each GPU once")
        chosen.append(found[0])
    return chosen
