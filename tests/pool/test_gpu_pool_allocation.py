"""hydra/launcher=gpu_pool inside a SLURM allocation (expgpu.pool.allocation, expgpu.pool.steps): the pool is
the allocation's GPUs on every node, each job an srun step on the node(s) it was given.

On the real 2-node local cluster (two slurmd on this machine, 4 fake GPUs each: SLURM sets
CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS of every step); the sweep runs as `salloc -N 2 --gres=gpu:4
--exclusive python -m expgpu -m ...`, as a user would type it. Every rank of every job records what
its step saw and when its model ran.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import slurm_cluster_2n  # noqa: F401

from conftest import pythonpath

RECORD_TASK = '''
import json, os, time
import torch


class Sleep(torch.nn.Linear):
    """Records what this rank's step gave it, sleeps, then trains like any model (or fails)."""

    def __init__(self, seconds=1.0, fail=False, tag=0):
        super().__init__(4, 1)
        self.fail = fail
        me = {k: os.environ.get(k) for k in ("EXPGPU_POOL_JOB", "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES",
                                             "SLURM_STEP_GPUS", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS",
                                             "SLURM_STEP_NODELIST", "OMP_NUM_THREADS", "MASTER_PORT")}
        me["cpus"] = sorted(os.sched_getaffinity(0))
        t0 = time.time()
        time.sleep(seconds)
        with open(os.environ["POOL_TEST_LOG"], "a") as f:
            f.write(json.dumps({**me, "t0": t0, "t1": time.time()}) + "\\n")

    def forward(self, x):
        if self.fail:
            raise RuntimeError("this job fails on purpose")
        return super().forward(x)
'''

RECORD_YAML = '''
model:
  _target_: alloc_task.Sleep
  seconds: 1.0
  fail: false
  tag: 0
dataset:
  _target_: expgpu.tasks.data.SmoothRegression
  size: 16
  in_features: 4
  out_features: 1
optimizer:
  _target_: torch.optim.SGD
  _partial_: true
  lr: 0.01
loss: mse
batch_size: 8
max_steps: 1
seed: 0
'''

# The two ways a job runs in an allocation: forked by a node's warm process, or an srun step of its own
BOTH_WAYS = pytest.mark.parametrize("warm", [True, False], ids=["forked by warm node processes", "srun steps"])


def way(warm: bool) -> str:
    """The override that picks the way (BOTH_WAYS' `warm`)."""
    return f"hydra.launcher.warm_starts={str(warm).lower()}"


SALLOC = ["salloc", "-N", "2", "--gres=gpu:4", "--exclusive", "--time=10"]


def _sweep(cluster, tmp: Path, overrides: list[str], salloc: list[str] = SALLOC, timeout: float = 240):
    code = tmp / "code"
    (code / "conf" / "task").mkdir(parents=True, exist_ok=True)
    (code / "alloc_task.py").write_text(RECORD_TASK)
    (code / "conf" / "task" / "record.yaml").write_text(RECORD_YAML)
    env = {**cluster.env, "POOL_TEST_LOG": str(tmp / "record.jsonl"),
           "PYTHONPATH": pythonpath(code)}
    cmd = [*salloc, sys.executable, "-m", "expgpu", "-m", "--config-dir", str(code / "conf"),
           "hydra/launcher=gpu_pool", f"hydra.sweep.dir={tmp / 'sweep'}", "task=record", "logger=none", *overrides]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


def _records(tmp: Path) -> list[dict]:
    path = tmp / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------------------------
# Real sweeps in a real 2-node allocation

def _by_job(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in records:
        out.setdefault(int(r["EXPGPU_POOL_JOB"]), []).append(r)
    return out


def _gpus(r: dict) -> set[tuple[str, int]]:
    """The (node, GPU) pairs SLURM gave this rank's step on its node."""
    assert r["CUDA_VISIBLE_DEVICES"] == r["SLURM_STEP_GPUS"], r
    return {(r["SLURMD_NODENAME"], int(g)) for g in r["SLURM_STEP_GPUS"].split(",")}


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(400)
@BOTH_WAYS
def test_a_sweep_of_1_and_2_gpu_jobs_shares_no_gpu_and_uses_both_nodes(slurm_cluster_2n, tmp_path, warm):
    # 12 jobs: 1 or 2 GPUs (gpu_map.gpus_per_rank), on 1 node or spread over 2 (launch.nodes)
    done = _sweep(slurm_cluster_2n, tmp_path, ["gpu_map.gpus_per_rank=1,2", "launch.nodes=1,2",
                                               "task.model.seconds=3", "task.model.tag=range(3)",
                                               way(warm)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pool = json.loads((tmp_path / "sweep" / "pool.json").read_text())
    assert [j["state"] for j in pool["jobs"]] == ["finished"] * 12
    assert sorted(pool["allocation"]["nodes"]) == sorted(slurm_cluster_2n.nodes)
    jobs = _by_job(_records(tmp_path))
    assert sorted(jobs) == list(range(12))
    for num, ranks in jobs.items():
        row = pool["jobs"][num]
        nodes = 2 if "launch.nodes=2" in row["overrides"] else 1
        per_node = 2 if "gpu_map.gpus_per_rank=2" in row["overrides"] else 1
        # one task per node, each with its own step's GPUs on its node, as the launcher counted them
        assert len(ranks) == nodes and {r["SLURM_NTASKS"] for r in ranks} == {str(nodes)}, ranks
        assert {r["SLURMD_NODENAME"] for r in ranks} == set(row["nodes"]), (ranks, row)
        assert all(len(_gpus(r)) == per_node for r in ranks), ranks
        assert len({r["SLURM_STEP_ID"] for r in ranks}) == 1
        assert row["need"] == nodes * per_node
    # no GPU of a node in two jobs' steps at once
    spans = [(num, r) for num, ranks in jobs.items() for r in ranks]
    for (a, x), (b, y) in itertools.combinations(spans, 2):
        if a != b and x["t0"] < y["t1"] and y["t0"] < x["t1"]:
            assert not _gpus(x) & _gpus(y), f"jobs #{a} and #{b} shared {_gpus(x) & _gpus(y)}"
    assert {r["SLURMD_NODENAME"] for r in _records(tmp_path)} == set(slurm_cluster_2n.nodes)
    at_once = max(sum(1 for _, o in spans if o["t0"] <= r["t0"] < o["t1"]) for _, r in spans)
    assert at_once >= 3, "jobs ran side by side"
    assert len({r["MASTER_PORT"] for r in _records(tmp_path)}) == 12   # a port of its own per job
    out = done.stdout + done.stderr
    assert ("waiting for the warm processes on 2 node(s)" in out) == warm and "warm starts off" not in out, out
    if warm:   # a rank's CPUs: its GPUs' share of the node's; with fewer CPUs than a node's 4 GPUs, all of them
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 4:
            assert all(r["cpus"] == cpus for r in _records(tmp_path))
        for (a, x), (b, y) in itertools.combinations(spans, 2):
            if len(cpus) >= 4 and a != b and x["SLURMD_NODENAME"] == y["SLURMD_NODENAME"] \
                    and x["t0"] < y["t1"] and y["t0"] < x["t1"]:
                assert not set(x["cpus"]) & set(y["cpus"]), f"jobs #{a} and #{b} shared CPUs"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(400)
@BOTH_WAYS
def test_an_allocation_without_gpus_runs_its_jobs_on_cpu_slots_of_every_node_and_no_gpu(slurm_cluster_2n, tmp_path,
                                                                                          warm):
    done = _sweep(slurm_cluster_2n, tmp_path, ["hydra.launcher.cpu_slots=2", "task.model.seconds=3",
                                               "task.model.tag=range(6)", way(warm)],
                  salloc=["salloc", "-N", "2", "--cpus-per-task=4", "--time=10"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 node(s)" in done.stdout + done.stderr and "x 2 CPU slot(s)" in done.stdout + done.stderr
    pool = json.loads((tmp_path / "sweep" / "pool.json").read_text())
    assert [j["state"] for j in pool["jobs"]] == ["finished"] * 6
    assert pool["allocation"]["cpu_slots_per_node"] == 2
    jobs = _by_job(_records(tmp_path))
    assert sorted(jobs) == list(range(6)) and all(len(ranks) == 1 for ranks in jobs.values())
    spans = [r for ranks in jobs.values() for r in ranks]
    assert all(not r["CUDA_VISIBLE_DEVICES"] and not r["SLURM_STEP_GPUS"] for r in spans), spans   # no GPU
    assert {r["SLURMD_NODENAME"] for r in spans} == set(slurm_cluster_2n.nodes)

    def together(r: dict, node: str | None = None) -> int:
        return sum(1 for o in spans if o["t0"] <= r["t0"] < o["t1"] and node in (None, o["SLURMD_NODENAME"]))

    assert max(together(r, r["SLURMD_NODENAME"]) for r in spans) <= 2, "at most a node's 2 CPU slots at once"
    assert max(together(r) for r in spans) >= 3, "jobs ran side by side, on both nodes"
    if warm and len(os.sched_getaffinity(0)) >= 2:   # each its slot's share of the node's CPUs
        for x, y in itertools.combinations(spans, 2):
            if x["SLURMD_NODENAME"] == y["SLURMD_NODENAME"] and x["t0"] < y["t1"] and y["t0"] < x["t1"]:
                assert not set(x["cpus"]) & set(y["cpus"]), (x, y)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_jobs_per_gpu_forks_that_many_jobs_onto_each_gpu_of_the_allocation(slurm_cluster_2n, tmp_path):
    # 2 nodes x 1 GPU, 2 jobs on each: 6 jobs of 3 s run 4 at once, never 3 on one GPU
    done = _sweep(slurm_cluster_2n, tmp_path, ["hydra.launcher.jobs_per_gpu=2", "task.model.seconds=3",
                                               "task.model.tag=range(6)"],
                  salloc=["salloc", "-N", "2", "--gres=gpu:1", "--cpus-per-task=4", "--time=10"])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "x 1 GPU(s), 2 jobs on each GPU" in out and "(share 2 of 2)" in out, out
    pool = json.loads((tmp_path / "sweep" / "pool.json").read_text())
    assert pool["jobs_per_gpu"] == 2 and [j["state"] for j in pool["jobs"]] == ["finished"] * 6
    assert {j["shares"][0] for j in pool["jobs"]} == {0, 1}
    spans = [r for ranks in _by_job(_records(tmp_path)).values() for r in ranks]
    assert len(spans) == 6 and all(len(_gpus(r)) == 1 for r in spans)

    def together(r: dict, same_gpu: bool) -> list[dict]:
        return [o for o in spans if o["t0"] <= r["t0"] < o["t1"] and (not same_gpu or _gpus(o) == _gpus(r))]

    assert max(len(together(r, True)) for r in spans) == 2, "two jobs on one GPU at once, never three"
    assert max(len(together(r, False)) for r in spans) >= 3, "jobs ran side by side on both nodes' GPUs"
    if len(os.sched_getaffinity(0)) >= 2:   # each share its half of its GPU's CPUs
        for r in spans:
            for o in together(r, True):
                assert o is r or not set(o["cpus"]) & set(r["cpus"]), (o, r)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_job_is_named_and_the_others_finish(slurm_cluster_2n, tmp_path):
    done = _sweep(slurm_cluster_2n, tmp_path, ["task.model.seconds=0.5", "task.model.fail=false,true,false"])
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    pool = json.loads((tmp_path / "sweep" / "pool.json").read_text())
    assert [j["state"] for j in pool["jobs"]] == ["finished", "failed", "finished"]
    assert "this job fails on purpose" in pool["jobs"][1]["error"]
    out = done.stdout + done.stderr
    lines = [ln for ln in out.splitlines() if "job #1 (" in ln and " failed: " in ln and " failed after " not in ln]
    assert len(lines) == 1 and "this job fails on purpose" in lines[0], out
    assert "expgpu: the sweep failed (its failed jobs are listed above)" in done.stderr
    assert "Traceback" not in done.stderr
    assert "this job fails on purpose" in (tmp_path / "sweep" / "1" / "console.log").read_text()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("overrides, message", [
    (["gpu_map.gpus_per_rank=6"], "expgpu: error: job #0 (task=record logger=none task.model.tag=0 "
     "gpu_map.gpus_per_rank=6) needs 6 GPUs on each of 1 node(s), but the allocation has at most 4 GPU(s) per node"),
    (["gpu_map.gpus_per_rank=6", "launch.nodes=2"], "but the allocation has at most 4 GPU(s) per node"),
    (["launch.nodes=3"], "asks for launch.nodes=3, but the allocation has 2 node(s); allowed: 1..2"),
    (["hydra.launcher.jobs_per_gpu=2", "hydra.launcher.warm_starts=false"], "expgpu: error: hydra.launcher."
     "jobs_per_gpu=2 is not allowed with hydra.launcher.warm_starts=false inside a SLURM allocation"),
])
def test_a_job_that_cannot_fit_the_allocation_is_one_line_and_exit_2(slurm_cluster_2n, tmp_path, overrides, message):
    done = _sweep(slurm_cluster_2n, tmp_path, ["task.model.tag=0,1", *overrides], timeout=120)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("expgpu")]
    assert len(said) == 1 and message in said[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not _records(tmp_path), "no job may start"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(400)
@BOTH_WAYS
def test_ctrl_c_stops_every_step_with_a_checkpoint_and_the_rerun_resumes_them(slurm_cluster_2n, tmp_path, warm):
    """The stop reaches the ranks of every step on every node through SLURM (scancel --signal), not srun's own
    handling (which would cancel the step on SIGTERM): they save and end stopped; the same sweep again resumes."""
    import psutil

    sweep = tmp_path / "sweep"
    cmd = [*SALLOC, sys.executable, "-m", "expgpu", "-m", "hydra/launcher=gpu_pool", f"hydra.sweep.dir={sweep}",
           "task=a", "task.max_steps=4000", "task.log_every=5", "faults.device_ms_per_example=0.2",
           "launch.nodes=1,2", "logger=none", way(warm)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=slurm_cluster_2n.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not all((sweep / str(n) / "metrics.jsonl").exists() for n in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        launcher = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                        if "expgpu" in " ".join(p.cmdline()))
        launcher.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, (out + err)[-3000:]
    for n in (0, 1):
        result = json.loads((sweep / str(n) / "result.json").read_text())
        assert result["status"] == "stopped" and result["stop_signal"] == "SIGINT", result
        assert (sweep / str(n) / "checkpoint.pt").exists()
    stopped = [json.loads((sweep / str(n) / "result.json").read_text())["steps"] for n in (0, 1)]
    again = subprocess.run(cmd, cwd=tmp_path, env=slurm_cluster_2n.env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    for n, step in zip((0, 1), stopped):
        result = json.loads((sweep / str(n) / "result.json").read_text())
        assert (result["status"], result["resumed_from_step"]) == ("finished", step), result


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
@BOTH_WAYS
def test_a_job_past_its_time_limit_is_stopped_through_slurm_saves_and_fails(slurm_cluster_2n, tmp_path, warm):
    # job 1's 2000 steps of 64 ms (paced) outlast the 30 s limit; SIGTERM reaches its ranks as a Ctrl-C's would
    sweep = tmp_path / "sweep"
    cmd = [*SALLOC, sys.executable, "-m", "expgpu", "-m", "hydra/launcher=gpu_pool", f"hydra.sweep.dir={sweep}",
           "task=a", "task.max_steps=20,2000", "task.log_every=5", "faults.device_ms_per_example=1.0",
           "logger=none", "hydra.launcher.timeout_min=0.5", way(warm)]
    done = subprocess.run(cmd, cwd=tmp_path, env=slurm_cluster_2n.env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    pool = {j["num"]: j for j in json.loads((sweep / "pool.json").read_text())["jobs"]}
    assert (pool[0]["state"], pool[1]["state"]) == ("finished", "failed"), pool
    assert pool[1]["error"].startswith("ran past hydra.launcher.timeout_min=0.5 (30 s)"), pool[1]
    assert 30 <= pool[1]["wall_s"] < 30 + 15, pool[1]   # it saved and ended on the SIGTERM, not at the SIGKILL
    result = json.loads((sweep / "1" / "result.json").read_text())
    assert (result["status"], result["stop_signal"]) == ("stopped", "SIGTERM") and result["steps"] < 2000, result
    assert (sweep / "1" / "checkpoint.pt").exists()
    assert "Traceback" not in done.stderr


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
@BOTH_WAYS
def test_a_job_stuck_past_its_time_limit_is_killed_on_its_node_after_the_grace(slurm_cluster_2n, tmp_path, warm):
    # job 1 sleeps in its model's constructor, before any step: only the SIGKILL grace_s after the limit ends it
    done = _sweep(slurm_cluster_2n, tmp_path, ["task.model.seconds=0.5,120", "hydra.launcher.timeout_min=0.25",
                                               "hydra.launcher.grace_s=3",
                                               way(warm)])
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    pool = {j["num"]: j for j in json.loads((tmp_path / "sweep" / "pool.json").read_text())["jobs"]}
    assert (pool[0]["state"], pool[1]["state"]) == ("finished", "failed"), pool
    assert pool[1]["error"].startswith("ran past hydra.launcher.timeout_min=0.25 (15 s)"), pool[1]
    assert 15 + 3 <= pool[1]["wall_s"] < 15 + 3 + 15, pool[1]
    assert [r["EXPGPU_POOL_JOB"] for r in _records(tmp_path)] == ["0"], "job 1 never got past its sleep"
    assert not _processes_of_job(tmp_path, "1"), "job 1's ranks outlived it on their node"


def _processes_of_job(tmp: Path, num: str) -> list[int]:
    """Live processes of this test's sweep (their POOL_TEST_LOG) that ran job `num` (the nodes are this machine)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("POOL_TEST_LOG") == str(tmp / "record.jsonl") and env.get("EXPGPU_POOL_JOB") == num:
            found.append(p.pid)
    return found
