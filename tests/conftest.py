"""Shared helpers: run the real CLI in a subprocess, read what a run left behind.

The tests sit by package, as src/expgpu does (tests/<package>/test_*.py; end-to-end CLI tests in
tests/e2e/); the probe tasks they run and the fixtures of real clusters live in tests/helpers/, which is
on the import path of the tests and, as PYTHONPATH (HELPERS), of the runs they start; tests/conf holds
the probes' task files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from expgpu.loggers.progress import FIELDS, PACE

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
HELPERS = TESTS / "helpers"   # the probe tasks (run_probe, ...) and the clusters' fixtures
sys.path.insert(0, str(HELPERS))

@pytest.fixture(autouse=True)
def _stop_signals_as_they_were():
    """A test that installs expgpu's stop signals in this process (StopSignals.install(only=...) ignores the
    others, as a supervisor's worker does) leaves them as they were: an ignored SIGINT is inherited by every
    process a later test starts, which then never sees a Ctrl-C."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


# Steps paced by a sleep: every rank sleeps 0.1 ms per example of its batch (6.4 ms a step of task
# a), a device computing while the CPU waits. For runs that must still be training when a signal,
# a requeue or a time limit comes, and for sweeps whose jobs must train at the same moment: the
# wait costs the cores nothing the tests beside them could use. It changes no result, so a paced
# run is compared with a paced reference.
PACED = "faults.device_ms_per_example=0.1"

# Variables a launcher around the test run (srun, torchrun, an expgpu spawn) may have
# set: a test decides for itself who started its processes.
LAUNCHER_PREFIXES = ("SLURM_", "EXPGPU_", "TORCHELASTIC_", "OMPI_", "PMI_", "MPI_LOCAL")
LAUNCHER_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "HYDRA_FULL_ERROR"}


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts. Its launches fork their ranks from this test
    process's warm server (expgpu.launch.warm_server): most of the suite's CPU was torch's import in
    each launch. EXPGPU_WARM_SERVER="" in `extra`: this launch starts its ranks as without one.
    PYTHONPATH in `extra` goes before the test run's own (where expgpu or its dependencies may come
    from, as on a GPU node with the packages unpacked to a folder: bench/gpu_session.sh)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if "EXPGPU_WARM_SERVER" not in extra:
        env["EXPGPU_WARM_SERVER"] = warm_server()
    if "PYTHONPATH" in extra:
        extra = {**extra, "PYTHONPATH": pythonpath(extra["PYTHONPATH"])}
    env.update(extra)
    return env


def cpu_env(**extra: str) -> dict[str, str]:
    """clean_env for runs whose subject is not the GPU: on the CPU on a GPU node too, as on a CPU machine.
    There a node's GPU changes what such a test sees: gpu_pool runs one job per GPU instead of on its CPU
    slots (two jobs no longer train at once), a job's start waits for CUDA's, and the plan and the log lines
    name the GPU. GPUs simulated by inventory.simulate are hidden too (the mask narrows them): not for those."""
    return clean_env(CUDA_VISIBLE_DEVICES="", **extra)


def pythonpath(*first) -> str:
    """`first` (paths), then the test run's own PYTHONPATH, as one PYTHONPATH."""
    return os.pathsep.join([*map(str, first), *filter(None, [os.environ.get("PYTHONPATH")])])


_warm: dict[str, str] = {}   # "path": the socket of this process's warm server, once started


def warm_server() -> str:
    """The socket of this test process's warm server, started on first use, stopped at exit."""
    if "path" not in _warm:
        import atexit
        import tempfile

        where = Path(tempfile.mkdtemp(prefix="expgpu-warm-"))   # short: a socket path has 107 bytes
        # It dies with this process (no preexec_fn: this process has threads, pytest-xdist's)
        env = clean_env(EXPGPU_WARM_SERVER="", EXPGPU_WARM_PARENT=str(os.getpid()))
        with open(where / "server.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "expgpu.warm_server", str(where / "s")], cwd=REPO,
                                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

        def stop():
            proc.terminate()
            if proc.wait(10) == 0:   # else its log says why
                shutil.rmtree(where, ignore_errors=True)

        atexit.register(stop)
        _warm["path"] = str(where / "s")
    return _warm["path"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def result(self) -> dict:
        return json.loads((self.run_dir / "result.json").read_text())

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


# What a metrics.jsonl row holds that depends on the clock: its wall time, its pace (expgpu.loggers.progress)
TIMED = frozenset({"time", *PACE})


def untimed(row: dict) -> dict:
    """A row without what the clock decides: two runs of the same steps log the same."""
    return {k: v for k, v in row.items() if k not in TIMED}


def logged(row: dict) -> dict:
    """A row's step and what was logged at it: no epoch, time or progress fields."""
    return {k: v for k, v in row.items() if k not in ("epoch", "time", *FIELDS)}


def expgpu(args: list[str], run_dir: Path, env: dict | None = None, timeout: float = 240,
           cmd: list[str] | None = None, cwd: Path = REPO) -> Run:
    """`python -m expgpu ARGS hydra.run.dir=RUN_DIR`, as a user would type it."""
    cmd = cmd or [sys.executable, "-m", "expgpu"]
    proc = subprocess.run(cmd + list(args) + [f"hydra.run.dir={run_dir}"], cwd=cwd,
                          env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


def multirun(args: list[str], sweep_dir: Path, env: dict, timeout: float = 150, cwd: Path = REPO):
    """`python -m expgpu -m ARGS hydra.sweep.dir=SWEEP_DIR`."""
    return subprocess.run([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def start(args: list[str], run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    """`python -m expgpu ARGS` in the background, in a session of its own."""
    # Its own session: a Ctrl-C sent to its process group does not reach pytest.
    return subprocess.Popen([sys.executable, "-m", "expgpu", *args, f"hydra.run.dir={run_dir}"],
                            cwd=REPO, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_progress(proc: subprocess.Popen, run_dir: Path, timeout: float = 90) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (code {proc.returncode}) before it showed progress: {err[-2000:]}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no metrics row in {metrics} after {timeout:.0f}s")


def wait_until(what: str, check, timeout: float, every: float = 0.1):
    """`check()`'s first truthy value, polled every `every` s; a test failure naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 90) -> Run:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the stopped run did not exit within {timeout:.0f}s: {err[-2000:]}")
    return Run(proc.returncode, out, err, run_dir)


def left_early(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """`CMD | head -1`: the reader takes the first line of a long output (over a pipe's 64 KiB) and leaves;
    the command's exit code, that line and its stderr."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, first, err)


def write_job(job_dir: Path, overrides: list[str], metrics: dict,
              series: dict[str, list[tuple[int, float]]] | None = None, status: str = "finished",
              objective: str | None = None) -> Path:
    """A job dir as a sweep leaves it (.hydra/overrides.yaml and config.yaml, result.json,
    metrics.jsonl), for the report: its rule and pictures on names no built-in task logs."""
    (job_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job_dir / ".hydra" / "config.yaml").write_text(f"objective: {objective or 'null'}\n")
    (job_dir / "result.json").write_text(json.dumps({"status": status, "metrics": metrics, "steps": 100}))
    rows: dict[int, dict] = {}
    for name, points in (series or {}).items():
        for step, value in points:
            rows.setdefault(step, {})[name] = value
    (job_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, **rows[step], "epoch": 0, "time": 1000.0 + step}) + "\n" for step in sorted(rows)))
    return job_dir


@pytest.hookimpl(wrapper=True)   # around pytest-xdist's, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    # The SLURM tests mostly wait on the cluster (scheduling, requeue delays, time limits): one
    # group, first, so that under `-n 3 --dist loadgroup` one worker waits through them from the
    # start while the others keep both cores busy (spread, they would idle one core at the end).
    slurm = [item for item in items if "slurm" in item.keywords]
    for item in slurm:
        item.add_marker(pytest.mark.xdist_group("slurm"))
    items[:] = slurm + [item for item in items if "slurm" not in item.keywords]
    yield
    # Decided without touching CUDA in this process (torch.cuda.is_available() may create
    # a context on GPU 0 in the test runner itself).
    from expgpu.gpus import inventory

    if inventory():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (NVML found none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
