"""nvidia-ml-py's pynvml as on a node with one H100: for `make check-gpu-node`, and for the one test of a GPU
node whose torch is the CPU build (tests/e2e/test_cli.py), which this machine is then.

A diagnostic without a GPU: on PYTHONPATH, expgpu's inventory (and each process a test starts) finds one
GPU, so a fast-tier test that would put a job on a GPU node's GPU does so here, where this torch has no
CUDA and the job fails ("Torch not compiled with CUDA enabled"). Such a test assumes a CPU machine; its
subject is seldom the GPU (tests/conftest.cpu_env). The real module is loaded and only what the inventory
asks of a device is answered here: the tests that monkeypatch pynvml themselves still find its errors
and constants."""

import importlib.machinery
import importlib.util
import os
import sys
from types import SimpleNamespace

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "pynvml", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is None:
    raise ImportError("one_gpu_nvml needs nvidia-ml-py installed (pip install nvidia-ml-py)")
_real = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _real   # `import pynvml` from here on is the real module, with the answers below
_spec.loader.exec_module(_real)

_H100 = {
    "nvmlInit": lambda: None,
    "nvmlShutdown": lambda: None,
    "nvmlDeviceGetCount": lambda: int(os.environ.get("ONE_GPU_NVML_COUNT", "1")),   # N for a test of several
    "nvmlDeviceGetHandleByIndex": lambda i: i,
    "nvmlDeviceGetHandleByUUID": lambda uuid: 0,
    "nvmlDeviceGetComputeRunningProcesses": lambda h: [],   # nothing computes on it (expgpu.pool.busy)
    "nvmlDeviceGetName": lambda h: "NVIDIA H100 80GB HBM3",
    "nvmlDeviceGetUUID": lambda h: "GPU-00000000-one-gpu-nvml" + (f"-{h}" if h else ""),
    "nvmlDeviceGetMigMode": lambda h: (0, 0),
    "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=80 * 2**30, free=79 * 2**30, used=2**30),
    "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=0, memory=0),
    "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=f"00000000:{h + 1:02X}:00.0".encode()),
    "nvmlDeviceGetArchitecture": lambda h: _real.NVML_DEVICE_ARCH_HOPPER,
    "nvmlDeviceGetNumGpuCores": lambda h: 16896,
    "nvmlDeviceGetMaxClockInfo": lambda h, kind: 1980,
    "nvmlSystemGetDriverVersion": lambda: "580.00",
}
for _name, _fn in _H100.items():
    setattr(_real, _name, _fn)
