"""A run started by hand leases its GPUs, as a gpu_pool job does (expgpu.launch.run_leases): it plans around
the GPUs other expgpu jobs lease (a sweep's, another run's), says which, holds the leases while it runs, and
is one line and exit 2 where too few are free. NVML answering as a node with N H100s
(tests/helpers/one_gpu_nvml, ONE_GPU_NVML_COUNT), the leases real flocks in a lease dir of the test's; this
torch is a CPU build, so a run planned on a GPU ends with exit 2 before its first step (tests/e2e/test_cli.py),
naming the GPU planned, after its leases."""

from __future__ import annotations

import json

import pytest

from conftest import HELPERS, clean_env, expgpu
from expgpu.gpus.inventory import Gpu
from expgpu.pool import leases


def _fake(tmp_path, gpus: int) -> dict:
    return clean_env(PYTHONPATH=str(HELPERS / "one_gpu_nvml"), ONE_GPU_NVML_COUNT=str(gpus), EXPGPU_WARM_SERVER="",
                     EXPGPU_LEASE_DIR=str(tmp_path / "leases"))


def _card(index: int) -> Gpu:
    """One of the fake node's GPUs as the lease files name it (its UUID; the host is this machine's)."""
    return Gpu(index, "NVIDIA H100 80GB HBM3", "GPU-00000000-one-gpu-nvml" + (f"-{index}" if index else ""), "",
               81920, 80896, 0, 132, 1980)


def _sweeps_job(tmp_path, index: int):
    """A gpu_pool sweep's job holding GPU `index`."""
    lease = leases.try_acquire(leases.lease_dir(str(tmp_path / "leases")), _card(index))
    lease.note(pid=4242, sweep="outputs/multirun/s", job=3)
    return lease


def _plan(run_dir) -> list[list[int]]:
    return [row["gpus"] for row in json.loads((run_dir / "plan.json").read_text())["ranks"]]


@pytest.mark.slow
def test_a_run_plans_around_a_gpu_a_sweep_leases_and_leases_its_own(tmp_path):
    theirs = _sweeps_job(tmp_path, 0)
    try:
        run = expgpu(["task=a", "task.max_steps=3"], tmp_path / "run", env=_fake(tmp_path, 2))
    finally:
        theirs.release()
    assert "expgpu: leased by other expgpu jobs: GPU 0: pid 4242 (job #3 of outputs/multirun/s); this run plans on " \
           "the GPUs no one leases: GPU 1" in run.stderr, run.stderr[-3000:]
    assert "(rank 0 was planned GPU 1: " in run.stderr, run.stderr[-3000:]   # then this CPU torch's line, exit 2
    # it held GPU 1's lease (the note it left); the run ended at this CPU torch's first step, which let it go
    assert leases.noted(tmp_path / "leases", _card(1))["run"] == str(run.run_dir)
    assert leases.describe_holder(leases.noted(tmp_path / "leases", _card(1))).endswith(f"(the run in {run.run_dir})")
    assert leases.holder(tmp_path / "leases", _card(1)) is None
    free = expgpu(["task=a", "task.max_steps=3"], tmp_path / "free", env=_fake(tmp_path, 2))
    assert "leases" not in free.stderr and "(rank 0 was planned GPU 0: " in free.stderr   # nothing leased: as before
    theirs = _sweeps_job(tmp_path, 0)
    try:   # on purpose beside the sweep's job: planned on every GPU, as before leases
        shared = expgpu(["task=a", "task.max_steps=3", "launch.lease_gpus=false"], tmp_path / "shared",
                        env=_fake(tmp_path, 2))
    finally:
        theirs.release()
    assert "leases" not in shared.stderr and "(rank 0 was planned GPU 0: " in shared.stderr, shared.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("gpus, args, message", [
    (1, [], "expgpu: error: every GPU this run may use is leased by other expgpu jobs (GPU 0: pid 4242 (job #3 of "
            "outputs/multirun/s)): wait for them, or queue the run in a sweep (hydra/launcher=gpu_pool waits for its "
            "GPUs)"),
    (2, ["launch.nproc_per_node=2"], "(leased by other expgpu jobs: GPU 0: pid 4242 (job #3 of outputs/multirun/s))"),
])
def test_a_run_with_too_few_gpus_free_is_one_line_and_exit_2(tmp_path, gpus, args, message):
    theirs = _sweeps_job(tmp_path, 0)
    try:
        run = expgpu(["task=a", "task.max_steps=3", *args], tmp_path / "run", env=_fake(tmp_path, gpus))
    finally:
        theirs.release()
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: error: ") and message in last, last
    assert not (run.run_dir / "plan.json").exists()


@pytest.mark.slow
def test_a_dry_run_and_simulated_gpus_lease_nothing_and_the_dry_run_says_what_is_leased(tmp_path):
    theirs = _sweeps_job(tmp_path, 0)
    try:
        dry = expgpu(["task=a", "dry_run=true"], tmp_path / "dry", env=_fake(tmp_path, 1))
        # NVML's GPU 0 (leased) is there too: only the simulated ones are planned on, and nothing is leased
        sim = expgpu(["task=a", "task.max_steps=3", "inventory.simulate=[{name:A100,memory_mb:40960}]"],
                     tmp_path / "sim", env=_fake(tmp_path, 1))
    finally:
        theirs.release()
    assert dry.returncode == 0 and _plan(dry.run_dir) == [[0]] and "lease" not in dry.stderr, dry.stderr[-3000:]
    # what the run would do, said: it would plan around the leased GPU
    assert "leased by other expgpu jobs now: GPU 0: pid 4242 (job #3 of outputs/multirun/s): the run would plan " \
           "around them (launch.lease_gpus=false: on them all the same)" in dry.stdout, dry.stdout
    assert sim.returncode == 0 and "lease" not in sim.stderr, sim.stderr[-3000:]
    assert not list((tmp_path / "leases").glob("*GPU-sim-*")), "a simulated GPU was leased"


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_on_a_real_gpu_a_sweep_started_beside_a_run_waits_for_the_runs_gpu(tmp_path):
    import subprocess
    import sys
    import time

    from conftest import REPO

    env = clean_env(EXPGPU_LEASE_DIR=str(tmp_path / "leases"))
    run = subprocess.Popen([sys.executable, "-m", "expgpu", "task=a", "task.max_steps=200000", "task.log_every=50",
                            f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.5)
        sweep = subprocess.run([sys.executable, "-m", "expgpu", "-m", "hydra/launcher=gpu_pool", "task=a",
                                "task.max_steps=10", "task.seed=0,1", "hydra.launcher.gpus=[0]",
                                "hydra.launcher.wait_timeout_s=3", "hydra.launcher.busy_gpus=use",
                                f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=200)
    finally:
        run.terminate()
        run.communicate(timeout=60)
    assert sweep.returncode == 1, sweep.stderr[-3000:]
    assert f"(the run in {tmp_path / 'run'})" in sweep.stdout + sweep.stderr   # leased, not only busy in NVML
