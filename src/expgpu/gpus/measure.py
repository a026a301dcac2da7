"""Measured GPU speed (gpu_map.score=measured): a short matmul benchmark per GPU, in TFLOP/s of
the dtype the task computes in, cached per GPU.

The planning process must never create a CUDA context (it would pin memory on every GPU and,
in a rank, fix CUDA_VISIBLE_DEVICES before isolation). So each GPU is measured by a child
process, `python -m expgpu.gpus.measure`, started with CUDA_VISIBLE_DEVICES naming that GPU
by UUID; the children of one node run at the same time, each on its own GPU.

Scores are cached in $EXPGPU_CACHE_DIR, else $XDG_CACHE_HOME/expgpu, else ~/.cache/expgpu
(gpu-scores.json), keyed by GPU UUID + driver version + torch version (its CUDA build
included: 2.5.1+cu124) + dtype: a new driver or torch measures again. A GPU busy with other
work when it is measured gets a low score: that score is used but not cached. Delete the file
to measure everything again.

A simulated inventory never runs CUDA: a simulated GPU's `score`, else a stand-in from its
spec (SM count x max clock x 256 FLOP per clock), which is deterministic but not a measurement.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from expgpu import envvars
from expgpu.errors import UserError
from expgpu.gpus.inventory import Gpu

log = logging.getLogger("expgpu")

DTYPES = ("float32", "float16", "bfloat16")
CACHE_FILE = "gpu-scores.json"
TIMEOUT_S = 180.0      # one child: importing torch and starting CUDA can take a while on a big node
BUSY_UTIL = 10         # % NVML utilization above which a measurement is not cached


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(envvars.CACHE_DIR):
        return Path(env[envvars.CACHE_DIR])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "expgpu"


def cache_key(uuid: str, driver: str, torch_version: str, dtype: str) -> str:
    return f"{uuid}|driver {driver}|torch {torch_version}|{dtype}"


def torch_version() -> str:
    """The installed torch's version without importing it (its local tag names the CUDA build)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:   # no NVML: the key still separates torch builds and dtypes
        return "unknown"


def stand_in(gpu: Gpu) -> float:
    """A simulated GPU's measured score: its given score, else a spec estimate in TFLOP/s."""
    if gpu.score is not None:
        return gpu.score
    return gpu.sm_count * gpu.clock_mhz * 256 / 1e6


def scored(gpus: Sequence[Gpu], dtype: str, simulated: bool, env: Mapping[str, str] | None = None,
           runner: Callable[[Gpu, str], float] | None = None) -> list[Gpu]:
    """`gpus` with .score set to their measured TFLOP/s (from the cache where it is valid)."""
    dtype = getattr(dtype, "value", dtype)
    if dtype not in DTYPES:
        raise UserError(f"gpu_map.measure_dtype={dtype!r}: unknown; allowed: {', '.join(DTYPES)}")
    if simulated:
        return [replace(g, score=stand_in(g)) for g in gpus]
    if not gpus:
        return []
    scores = Cache(cache_dir(env), driver_version(), torch_version(), dtype).scores(
        gpus, runner or (lambda g, d: measure_in_child(g, d, env)))
    return [replace(g, score=scores[g.index]) for g in gpus]


class Cache:
    """gpu-scores.json under a file lock: read, measure what is missing, write atomically."""

    def __init__(self, directory: Path, driver: str, torch_ver: str, dtype: str):
        self.path = Path(directory) / CACHE_FILE
        self.driver, self.torch, self.dtype = driver, torch_ver, dtype

    def key(self, gpu: Gpu) -> str:
        return cache_key(gpu.uuid, self.driver, self.torch, self.dtype)

    def read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:   # a cache, not user data: measure again and rewrite it
            log.warning("ignoring unreadable GPU score cache %s (%s)", self.path, e)
            return {}

    def scores(self, gpus: Sequence[Gpu], run: Callable[[Gpu, str], float]) -> dict[int, float]:
        from filelock import FileLock, Timeout

        from expgpu.rundir import atomic_write_bytes

        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Held while measuring: two processes planning at once (torchrun's local rank 0 on a
        # restart, a sweep) must not benchmark the same GPU together and cache half a score.
        lock = FileLock(str(self.path) + ".lock")
        try:
            lock.acquire(timeout=TIMEOUT_S * 2)
        except Timeout:
            raise UserError(f"gpu_map.score=measured: another process holds {lock.lock_file} for more than "
                            f"{TIMEOUT_S * 2:.0f}s; wait for it, or use gpu_map.score=spec") from None
        try:
            cached = self.read()
            result = {g.index: float(cached[self.key(g)]["tflops"]) for g in gpus
                      if isinstance(cached.get(self.key(g)), dict) and "tflops" in cached[self.key(g)]}
            todo = [g for g in gpus if g.index not in result]
            if not todo:
                return result
            log.info("measuring %s matmul speed of GPU(s) %s (once; cached in %s)", self.dtype,
                     ", ".join(str(g.index) for g in todo), self.path)
            measured = run_all(todo, self.dtype, run)
            for g in todo:
                result[g.index] = measured[g.index]
                if g.utilization > BUSY_UTIL:
                    log.warning("GPU %d was %d%% busy while measured (%.3g TFLOP/s): score used, not cached",
                                g.index, g.utilization, measured[g.index])
                    continue
                cached[self.key(g)] = {"tflops": measured[g.index], "name": g.name, "uuid": g.uuid,
                                       "driver": self.driver, "torch": self.torch, "dtype": self.dtype,
                                       "measured_at": round(time.time(), 3)}
            atomic_write_bytes(self.path, (json.dumps(cached, indent=1, sort_keys=True) + "\n").encode())
            return result
        finally:
            lock.release()


def run_all(gpus: Sequence[Gpu], dtype: str, run: Callable[[Gpu, str], float]) -> dict[int, float]:
    """Measure every GPU at once (each child on its own GPU); threads only wait on children."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        futures = {g.index: pool.submit(run, g, dtype) for g in gpus}
        return {i: f.result() for i, f in futures.items()}


def measure_in_child(gpu: Gpu | None, dtype: str, env: Mapping[str, str] | None = None,
                     timeout_s: float = TIMEOUT_S, device: str = "cuda") -> float:
    """TFLOP/s of `gpu`, measured by a child process that sees only that GPU (device="cpu":
    the same child on the CPU, with no GPU at all)."""
    from expgpu.gpus.mask import gpu_env

    child_env = dict(os.environ if env is None else env)
    child_env.update(gpu_env([gpu] if device == "cuda" else [], child_env.get("CUDA_DEVICE_ORDER")))
    what = f"GPU {gpu.index} ({gpu.name})" if gpu is not None else "the CPU"
    cmd = [sys.executable, "-m", "expgpu.gpus.measure", "--dtype", dtype, "--device", device]
    try:
        proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"gpu_map.score=measured: the benchmark on {what} took more than {timeout_s:.0f}s; "
                        "use gpu_map.score=spec or give gpu_map.scores") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise UserError(f"gpu_map.score=measured: the benchmark on {what} failed ({last}); "
                        "use gpu_map.score=spec or give gpu_map.scores")
    return float(json.loads(lines[-1])["tflops"])


def benchmark(device: str = "cuda", dtype: str = "float32", seconds: float = 0.25) -> float:
    """Best of 3 timed runs of n x n matmuls, in TFLOP/s (2 n^3 FLOP each). In the child only."""
    import torch

    dev = torch.device(device)
    dt = getattr(torch, dtype)
    n = 8192 if dev.type == "cuda" and dtype != "float32" else 4096 if dev.type == "cuda" else 512
    a = torch.randn(n, n, device=dev).to(dt)
    b = torch.randn(n, n, device=dev).to(dt)

    def timed(k: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(k):
            torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    timed(3)                                   # warm-up: kernels, clocks, allocator
    k = max(1, int(seconds / max(timed(1), 1e-6)))
    best = min(timed(k) for _ in range(3))
    return 2 * n ** 3 * k / best / 1e12


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m expgpu.gpus.measure",
                                 description="matmul TFLOP/s of the one device this process sees")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seconds", type=float, default=0.25)
    args = ap.parse_args(argv)
    tflops = benchmark(args.device, args.dtype, args.seconds)
    print(json.dumps({"tflops": tflops, "device": args.device, "dtype": args.dtype}), flush=True)


if __name__ == "__main__":
    main()
