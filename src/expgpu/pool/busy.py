"""hydra.launcher.busy_gpus: GPUs that processes outside expgpu compute on.

On a shared workstation a GPU may be busy with work the pool knows nothing of: a colleague's training, a
notebook's CUDA context, another tool's job (what nvidia-smi lists under Processes). Leases
(expgpu.pool.leases) keep expgpu's sweeps apart, not those. With `wait` (the default) the pool gives no job a
GPU that such a process computes on, as if another sweep leased it: it waits for it to free, says who holds
it, and gives up after hydra.launcher.wait_timeout_s as for leases. `use` gives it all the same (the jobs
share it with that process, its memory too).

What counts: NVML's compute processes (not graphics ones: a desktop's X server) on a GPU that no expgpu job
holds, neither a lease on it nor on any share of it (this sweep's or another's), so expgpu's own jobs are
never counted, whatever PID namespace (a container) NVML reports them in. A busy GPU is asked again at most
once every CHECK_S. With inventory.simulate, a simulated GPU's `processes` (a list of PIDs) stand for NVML's
list: those of them still alive.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

CHECK_S = 1.0   # a busy GPU is asked again at most this often (an NVML query each round would cost its loop)


@dataclass(frozen=True)
class Process:
    pid: int
    name: str
    used_mb: int | None   # None where NVML does not say (no permission, some drivers)

    def __str__(self) -> str:
        used = f", {self.used_mb / 1024:.1f} GiB" if self.used_mb else ""
        return f"pid {self.pid}{f' {self.name}' if self.name else ''}{used}"


class Others:
    """What computes on this machine's GPUs: NVML's answer (or the simulated GPUs'), kept CHECK_S while busy."""

    def __init__(self, simulate: Sequence[Any] | None = None):
        self.simulate = simulate
        self._nvml: Any = None
        self._asked: dict[str, tuple[float, list[Process]]] = {}   # GPU UUID -> (when, what computes on it)

    def on(self, gpu: Any) -> list[Process]:
        """The compute processes on `gpu` now (a Gpu, or a share of one)."""
        now = time.monotonic()
        when, procs = self._asked.get(gpu.uuid, (0.0, []))
        if procs and now - when < CHECK_S:
            return procs
        procs = self._simulated(gpu) if self.simulate is not None else self._from_nvml(gpu)
        self._asked[gpu.uuid] = (now, procs)
        return procs

    def _simulated(self, gpu: Any) -> list[Process]:
        spec = self.simulate[gpu.index] if gpu.index < len(self.simulate) else {}
        return [Process(pid, _name(pid), None) for pid in spec.get("processes") or [] if _alive(pid)]

    def _from_nvml(self, gpu: Any) -> list[Process]:
        try:
            import pynvml
        except ImportError:
            return []
        try:
            if self._nvml is None:
                pynvml.nvmlInit()
                self._nvml = pynvml
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            found = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError:   # a GPU NVML cannot answer for: nothing known to compute on it
            return []
        return [Process(p.pid, _name(p.pid), _mb(getattr(p, "usedGpuMemory", None))) for p in found]

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None


def describe(gpu: Any, procs: Sequence[Process]) -> str:
    """'GPU 0: 2 processes outside expgpu (pid 4242 python, 10.2 GiB; pid 4343 python)'."""
    shown = "; ".join(str(p) for p in procs[:3]) + ("; ..." if len(procs) > 3 else "")
    return f"GPU {gpu.index}: {len(procs)} process{'es' if len(procs) > 1 else ''} outside expgpu ({shown})"


def _alive(pid: Any) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"   # a zombie computes on nothing
    except (OSError, IndexError):
        return False


def _name(pid: int) -> str:
    """Its command's name (/proc); '' where this process cannot see it (another PID namespace)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _mb(used: Any) -> int | None:
    return used // (1 << 20) if isinstance(used, int) and used > 0 else None
