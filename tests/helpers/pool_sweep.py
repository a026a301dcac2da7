"""A gpu_pool sweep of a task whose model sleeps a known time and records what its process saw
(CUDA_VISIBLE_DEVICES, the lease, the CPU slot, when it ran), and what tests read of it afterwards: the
records, the pool's own account (pool.json), the report, the launcher's job processes and its leases.
Used by tests/pool/test_gpu_pool.py and test_pool_jobs.py."""

from __future__ import annotations

import csv
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import clean_env
from expgpu.gpus import inventory
from expgpu.pool import leases

SLEEP_TASK = '''
import atexit, json, os, signal, time
import torch


def _log(rec):
    with open(os.environ["POOL_TEST_LOG"], "a") as f:
        f.write(json.dumps(rec) + "\\n")


# Where and when this module was imported: a warm spare imports it before its process has a job.
_log({"event": "import", "pid": os.getpid(), "job": int(os.environ.get("EXPGPU_POOL_JOB", "-1"))})


def hang_forever():
    time.sleep(3600)


class Sleep(torch.nn.Linear):
    """Records what this job's process sees, sleeps, then trains like any model (or fails)."""

    def __init__(self, seconds=1.0, fail="", tag=0, at_exit=""):
        super().__init__(4, 1)
        self.fail = fail
        me = {"job": int(os.environ.get("EXPGPU_POOL_JOB", "-1")), "pid": os.getpid(), "tag": tag,
              "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "lease": os.environ.get("EXPGPU_POOL_GPUS"),
              "slot": os.environ.get("EXPGPU_POOL_SLOT"), "omp": os.environ.get("OMP_NUM_THREADS"),
              "mkl": os.environ.get("MKL_NUM_THREADS"), "blas": os.environ.get("OPENBLAS_NUM_THREADS"),
              "torch_threads": torch.get_num_threads(),
              "cuda_initialized": torch.cuda.is_initialized()}
        if at_exit == "write":   # what users do to flush W&B, close files, write summaries
            atexit.register(_log, {**me, "event": "atexit"})
        elif at_exit == "hang":
            atexit.register(hang_forever)
        _log({**me, "event": "start", "t": time.time()})
        time.sleep(seconds)
        _log({**me, "event": "end", "t": time.time()})

    def forward(self, x):
        if self.fail == "raise":
            raise RuntimeError("this job fails on purpose")
        if self.fail == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)
'''

SLEEP_YAML = '''
model:
  _target_: pool_task.Sleep
  seconds: 1.0
  fail: ""
  tag: 0
  at_exit: ""
dataset:
  _target_: expgpu.tasks.data.SmoothRegression
  size: 64
  in_features: 4
  out_features: 1
optimizer:
  _target_: torch.optim.SGD
  _partial_: true
  lr: 0.01
loss: mse
batch_size: 16
max_steps: 1
seed: 0
'''


def simulate(n: int) -> str:
    return "inventory.simulate=[" + ",".join(["{name:A100,memory_mb:40960}"] * n) + "]"


class Sweep:
    """One `python -m expgpu -m hydra/launcher=gpu_pool ...` with its sweep dir, records and leases."""

    def __init__(self, tmp: Path, name: str = "sweep", lease_dir: Path | None = None, **env: str | None):
        self.tmp, self.dir = tmp, tmp / name
        self.log = tmp / f"{name}.jsonl"
        self.lease_dir = lease_dir or tmp / "leases"
        code = tmp / "code"
        (code / "conf" / "task").mkdir(parents=True, exist_ok=True)
        (code / "pool_task.py").write_text(SLEEP_TASK)
        (code / "conf" / "task" / "sleep.yaml").write_text(SLEEP_YAML)
        self.code = code
        self.env = clean_env(PYTHONPATH=str(code), POOL_TEST_LOG=str(self.log),
                             EXPGPU_LEASE_DIR=str(self.lease_dir))
        for key, value in env.items():   # None: not set at all (as OMP_NUM_THREADS for most users)
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value
        self.proc: subprocess.Popen | None = None

    def args(self, overrides: list[str]) -> list[str]:
        return [sys.executable, "-m", "expgpu", "-m", "--config-dir", str(self.code / "conf"),
                "hydra/launcher=gpu_pool", f"hydra.sweep.dir={self.dir}", *overrides]

    def start(self, overrides: list[str]) -> "Sweep":
        # Its own process group, as a shell gives a foreground command: Ctrl-C goes to the group.
        self.proc = subprocess.Popen(self.args(overrides), cwd=self.tmp, env=self.env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        return self

    def wait(self, timeout: float = 180) -> subprocess.CompletedProcess:
        out, err = self.proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def run(self, overrides: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
        return self.start(overrides).wait(timeout)

    def records(self, event: str = "end") -> list[dict]:
        if not self.log.exists():
            return []
        return [r for r in map(json.loads, self.log.read_text().splitlines()) if r["event"] == event]

    def pool(self) -> dict:
        return json.loads((self.dir / "pool.json").read_text())


def runs(sweep: Sweep) -> list[dict]:
    """One row per job: what its process saw (its record) and when the launcher ran it (pool.json).

    The launcher's start..end covers the job's whole process, so two rows whose spans do not
    overlap never ran at once."""
    pool = {j["num"]: j for j in sweep.pool()["jobs"]}
    return [{**r, "t0": pool[r["job"]]["started"], "t1": pool[r["job"]]["ended"]} for r in sweep.records("end")]


def windows(sweep: Sweep) -> list[dict]:
    """One row per job: from its model's start to the end of its sleep, as the job's process saw
    it. Across sweeps this is the evidence: a job holds its lease from before this window to after
    it, while each launcher only learns a moment later that a job has ended."""
    starts = {r["pid"]: r for r in sweep.records("start")}
    return [{**r, "t0": starts[r["pid"]]["t"], "t1": r["t"]} for r in sweep.records("end")]


def overlapping(intervals: list[dict]) -> list[tuple[dict, dict]]:
    return [(a, b) for a, b in itertools.combinations(intervals, 2) if a["t0"] < b["t1"] and b["t0"] < a["t1"]]


def most_at_once(intervals: list[dict]) -> int:
    return max(sum(1 for o in intervals if o["t0"] <= i["t0"] < o["t1"]) for i in intervals)


def gpus_of(record: dict) -> set[int]:
    return {int(x) for x in record["cvd"].split(",") if x != ""}


def wait_for(cond, timeout: float, sweep: Sweep | None = None) -> None:
    """Until cond(); with a sweep, fail at once if it ended first."""
    deadline = time.monotonic() + timeout
    while not cond():
        if sweep is not None and sweep.proc.poll() is not None and not cond():
            out, err = sweep.proc.communicate()
            pytest.fail(f"the sweep ended early ({sweep.proc.returncode}): {err[-2000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def report_rows(sweep: Sweep) -> list[tuple[str, str, str]]:
    """(job, status, devices) per row of `python -m expgpu.report` on the sweep dir."""
    done = subprocess.run([sys.executable, "-m", "expgpu.report", str(sweep.dir), "--no-plot"], env=sweep.env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with open(sweep.dir / "report.csv", newline="") as f:
        return [(r["job"], r["status"], r["devices"]) for r in csv.DictReader(f)]


def processes_of(launcher: int) -> list[int]:
    """Live processes the launcher started for its jobs (they carry its pid in their environment)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "expgpu.pool.job_process" in (p.info["cmdline"] or []) and \
                    p.environ().get("EXPGPU_POOL_PARENT") == str(launcher) and alive(p.pid):
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def all_leases_free(sweep: Sweep, n: int) -> None:
    gpus = inventory([{"name": "A100", "memory_mb": 40960}] * n, env={})
    deadline = time.monotonic() + 10
    while any(leases.holder(sweep.lease_dir, g) for g in gpus):
        assert time.monotonic() < deadline, [leases.holder(sweep.lease_dir, g) for g in gpus]
        time.sleep(0.05)
