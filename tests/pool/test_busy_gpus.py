"""hydra.launcher.busy_gpus: a GPU that a process outside expgpu computes on gets no job of the sweep until it
frees (expgpu.pool.busy). On simulated GPUs whose `processes` are real processes of this machine (a `sleep`):
the pool sees one compute on the GPU while it lives, as NVML would list it. The leases with real flocks."""

from __future__ import annotations

import subprocess
import time

import pytest
from pool_sweep import Sweep, gpus_of, runs

from expgpu.gpus import inventory
from expgpu.pool import busy, leases, sharing


def _cards(*pids: list[int]) -> str:
    """inventory.simulate with one GPU per entry, each computed on by these processes."""
    return "inventory.simulate=[" + ",".join(f"{{name:A100,memory_mb:40960,processes:{list(p)}}}" for p in pids) + "]"


def test_a_simulated_gpus_processes_are_those_of_its_pids_still_alive():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        specs = [{"name": "A100", "memory_mb": 40960, "processes": [sleeper.pid, 999999999]}]
        gpu = inventory(specs, env={})[0]
        others = busy.Others(specs)
        procs = others.on(gpu)
        assert [(p.pid, p.name) for p in procs] == [(sleeper.pid, "sleep")]
        assert busy.describe(gpu, procs) == f"GPU 0: 1 process outside expgpu (pid {sleeper.pid} sleep)"
    finally:
        sleeper.kill()
        sleeper.wait()
    others._asked.clear()   # (a busy answer is kept CHECK_S)
    assert others.on(gpu) == []   # it ended (and was reaped): the GPU is free


def test_a_share_held_by_another_expgpu_job_is_expgpus_not_a_process_outside_it(tmp_path):
    gpu = inventory([{"name": "A100", "memory_mb": 40960}], env={})[0]
    first, second = sharing.shares([gpu], 2)
    mine = leases.try_acquire(tmp_path, first)
    assert not leases.shared_elsewhere(tmp_path, first, [0])   # only this share held, by us
    theirs = leases.try_acquire(tmp_path, second)
    assert leases.shared_elsewhere(tmp_path, first, [0])        # another job holds share 2
    assert not leases.shared_elsewhere(tmp_path, first, [0, 1])
    theirs.release()
    assert not leases.shared_elsewhere(tmp_path, first, [0])
    assert not leases.shared_elsewhere(tmp_path, gpu, [])        # a whole-card lease is exclusive
    mine.release()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jobs_wait_for_a_gpu_a_process_outside_expgpu_computes_on_and_start_when_it_ends(tmp_path):
    # The outside process lives until the sweep has started a job and said why the others wait, and 2 s more
    # (not a fixed time: on a slow machine the sweep's start alone can take longer than any fixed sleep).
    sleeper = subprocess.Popen(["sleep", "150"])
    sweep = Sweep(tmp_path)
    before: list[dict] = []
    said: set = set()
    seen_at, deadline = None, time.time() + 120
    waiting = f"waiting for GPUs in use outside expgpu (GPU 0: 1 process outside expgpu (pid {sleeper.pid} sleep))"
    try:
        sweep.start(["task=sleep", "task.model.seconds=2", "task.model.tag=range(6)", _cards([sleeper.pid], [])])
        while time.time() < deadline and (seen_at is None or time.time() < seen_at + 2):
            before = sweep.records("start")   # what started while the process computed on GPU 0
            try:
                said.add(sweep.pool().get("waiting"))   # and why the others wait
            except (OSError, ValueError):   # not written yet
                pass
            if seen_at is None and before and waiting in said:
                seen_at = time.time()
            time.sleep(0.1)
    finally:
        sleeper.kill()
        sleeper.wait()
    freed = time.time()
    assert before and all(gpus_of(r) == {1} for r in before), before   # GPU 1 alone till then
    # pool.json says why the queued jobs wait (expgpu status shows it)
    assert waiting in said, said
    done = sweep.wait(120)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert f"GPU 0: 1 process outside expgpu (pid {sleeper.pid} sleep): no job of this sweep starts on it" in out, out
    jobs = runs(sweep)
    on_0 = [j for j in jobs if gpus_of(j) == {0}]
    assert len(jobs) == 6 and on_0, jobs   # GPU 0 took jobs once it was free
    assert all(j["t0"] > freed - 1 for j in on_0), (freed, on_0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_with_every_gpu_busy_outside_expgpu_the_jobs_give_up_after_wait_timeout_and_use_takes_them(tmp_path):
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        sweep = Sweep(tmp_path)
        done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.tag=0,1", _cards([sleeper.pid]),
                          "hydra.launcher.wait_timeout_s=1"], timeout=60)
        assert done.returncode == 1, done.stderr
        waiting = f"waiting for GPUs in use outside expgpu (GPU 0: 1 process outside expgpu (pid {sleeper.pid} sleep))"
        assert waiting in done.stdout, done.stdout
        jobs = sweep.pool()["jobs"]
        assert [j["state"] for j in jobs] == ["failed", "failed"]
        assert "no GPU within hydra.launcher.wait_timeout_s=1s; in use outside expgpu: GPU 0: 1 process" \
            in jobs[0]["error"]
        used = Sweep(tmp_path, "used")
        done = used.run(["task=sleep", "task.model.seconds=0", "task.model.tag=0,1", _cards([sleeper.pid]),
                         "hydra.launcher.busy_gpus=use"], timeout=60)
        assert done.returncode == 0, done.stderr
        assert [gpus_of(r) for r in used.records("start")] == [{0}, {0}]
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("override, message", [
    ("hydra.launcher.busy_gpus=skip", "hydra.launcher.busy_gpus='skip' is not allowed: wait or use"),
    ("inventory.simulate=[{name:A100,memory_mb:1,processes:12}]",
     "inventory.simulate[0].processes=12: expected a list of process ids, e.g. [4242]"),
])
def test_bad_busy_settings_are_one_line(tmp_path, override, message):
    done = Sweep(tmp_path).run(["task=sleep", "task.model.tag=0,1", *override.split()], timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"expgpu: error: {message}", done.stderr


FOREIGN = "import sys, time, torch; torch.zeros(1, device='cuda'); print('up', flush=True); time.sleep(60)"


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_on_a_real_gpu_a_cuda_process_outside_expgpu_is_waited_for_and_expgpus_own_jobs_are_not(tmp_path):
    import sys

    foreign = subprocess.Popen([sys.executable, "-c", FOREIGN], stdout=subprocess.PIPE, text=True)
    try:
        assert foreign.stdout.readline().strip() == "up"   # its CUDA context is on GPU 0: NVML lists it
        sweep = Sweep(tmp_path, lease_dir=tmp_path / "gpu-leases")
        done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.tag=0,1", "hydra.launcher.gpus=[0]",
                          "hydra.launcher.wait_timeout_s=3"], timeout=120)
        assert done.returncode == 1, done.stderr
        assert f"GPU 0: 1 process outside expgpu (pid {foreign.pid} python" in done.stdout + done.stderr
    finally:
        foreign.kill()
        foreign.wait()
    # two jobs of one sweep on its shares: each is expgpu's, never "outside" for the other
    again = Sweep(tmp_path, "again", lease_dir=tmp_path / "gpu-leases")
    done = again.run(["task=a", "task.max_steps=1500", "task.seed=0,1", "hydra.launcher.gpus=[0]",
                      "hydra.launcher.jobs_per_gpu=2", "hydra.launcher.wait_timeout_s=30"], timeout=200)
    assert done.returncode == 0, done.stderr
    jobs = again.pool()["jobs"]
    assert "outside expgpu" not in done.stdout + done.stderr
    assert jobs[0]["started"] < jobs[1]["ended"] and jobs[1]["started"] < jobs[0]["ended"], jobs   # side by side
