"""hydra/launcher=gpu_pool: parallel sweeps, one job per leased GPU or CPU slot.

Scheduling tests run a tiny task whose model sleeps a known time and records what its process saw
(CUDA_VISIBLE_DEVICES, the lease, the CPU slot, when it ran); one test runs real training jobs.
All run the real CLI in real processes; GPUs are simulated (inventory.simulate) except in the
test marked gpu.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hydra_optuna import hydra_optuna, with_path  # noqa: F401  (a fixture)

from conftest import clean_env, expgpu
from expgpu.gpus import inventory
from expgpu.pool import Scheduler, leases
from expgpu.pool.scheduler import at_once, thread_budget
from expgpu.rundir import STATE

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


# ---------------------------------------------------------------------------------------------
# The scheduler alone (pure)

def test_scheduler_fills_free_gpus_in_order_and_mixes_sizes():
    s = Scheduler(patience=4)
    starts = s.pick([("a", 2), ("b", 1), ("c", 2), ("d", 1)], [0, 1, 2, 3], [], room=10)
    assert starts == [("a", (0, 1), None), ("b", (2,), None), ("d", (3,), None)]  # c waits: 1 GPU left
    # c needs 2, only 1 free: later 1-GPU jobs pass it...
    assert s.pick([("c", 2), ("e", 1)], [1], [], room=10) == [("e", (1,), None)]
    # ...and c starts as soon as 2 are free.
    assert s.pick([("c", 2), ("f", 1)], [0, 3], [], room=10) == [("c", (0, 3), None)]


def test_scheduler_stops_passing_a_blocked_job_after_patience():
    s = Scheduler(patience=2)
    queue = [("big", 2)] + [(f"small{i}", 1) for i in range(6)]
    assert s.pick(queue, [0], [], 10) == [("small0", (0,), None)]
    assert s.pick(queue[:1] + queue[2:], [1], [], 10) == [("small1", (1,), None)]
    assert s.pick(queue[:1] + queue[3:], [0], [], 10) == []          # passed twice: GPUs are kept
    assert s.pick(queue[:1] + queue[3:], [0, 1], [], 10) == [("big", (0, 1), None)]


def test_scheduler_cpu_slots_and_room():
    s = Scheduler(patience=1)
    assert s.pick([("a", 0), ("b", 0), ("c", 0)], [], [0, 1], room=10) == [("a", (), 0), ("b", (), 1)]
    assert s.pick([("a", 1), ("b", 1), ("c", 1)], [0, 1, 2], [], room=2) == [("a", (0,), None), ("b", (1,), None)]


def test_only_hydras_and_expgpus_own_code_is_primed_on_real_gpus():
    from types import SimpleNamespace

    from hydra.experimental.callback import Callback

    from expgpu import app
    from expgpu.pool.spares import primable
    from expgpu.report.callback import SweepReport

    def users_main(cfg):
        return cfg

    ours = SimpleNamespace(callbacks=SimpleNamespace(callbacks=[SweepReport()]))
    assert primable(ours, app.run, own_code=False)         # expgpu's app: its task modules come after the hand-over
    assert not primable(ours, users_main, own_code=False)  # another app's function imports the user's modules
    assert primable(ours, users_main, own_code=True)       # CPU slots, simulated GPUs: no CUDA to get wrong

    class Theirs(Callback):
        def on_job_start(self, config, **kwargs):
            pass

    theirs = SimpleNamespace(callbacks=SimpleNamespace(callbacks=[SweepReport(), Theirs()]))
    assert not primable(theirs, app.run, own_code=True)    # its on_job_start would run before the hand-over


def test_thread_budget_shares_the_cores_among_the_jobs_that_run_at_once():
    assert at_once([0] * 6, n_gpus=0, cpu_slots=2, max_parallel=None) == 2
    assert thread_budget(2, [0] * 6, 0, 2, None) == 1           # 2 cores, 2 slots: 1 thread each
    assert thread_budget(16, [0] * 6, 0, 2, None) == 8
    assert thread_budget(16, [0], 0, 4, None) == 16              # one job alone gets every core
    assert thread_budget(16, [1] * 8, 4, 1, None) == 4           # 4 GPU jobs at once
    assert thread_budget(16, [2] * 8, 4, 1, None) == 8           # 2-GPU jobs: 2 at once
    assert thread_budget(16, [1] * 8, 4, 1, max_parallel=2) == 8
    assert thread_budget(2, [1] * 8, 8, 1, None) == 1            # never 0


# ---------------------------------------------------------------------------------------------
# Sweeps

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cpu_slots_run_six_jobs_two_at_a_time(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=0.5", "task.model.tag=range(6)",
                      "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    jobs = runs(sweep)
    assert sorted(j["tag"] for j in jobs) == list(range(6))
    assert most_at_once(jobs) == 2, "six jobs, two CPU slots: two at a time, never three"
    assert {j["slot"] for j in jobs} == {"0", "1"}
    for a, b in overlapping(jobs):
        assert a["slot"] != b["slot"], f"jobs #{a['job']} and #{b['job']} ran at once on one slot"
    # Hydra's usual multirun layout, one dir per job, each a finished expgpu run.
    assert (sweep.dir / "multirun.yaml").exists()
    for n in range(6):
        assert (sweep.dir / str(n) / ".hydra" / "overrides.yaml").exists()
        assert json.loads((sweep.dir / str(n) / "result.json").read_text())["status"] == "finished"
    assert [j["state"] for j in sweep.pool()["jobs"]] == ["finished"] * 6


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_job_sees_exactly_its_leased_gpus_and_sizes_mix(tmp_path):
    sweep = Sweep(tmp_path)
    # Jobs of 1 and 2 GPUs (gpu_map.gpus_per_rank) on a pool of 3: they must mix without deadlock.
    done = sweep.run(["task=sleep", "task.model.seconds=0.5", "gpu_map.gpus_per_rank=2,1",
                      "task.model.tag=range(2)", simulate(3)])
    assert done.returncode == 0, done.stderr
    jobs = runs(sweep)
    assert len(jobs) == 4
    pool = {j["num"]: j for j in sweep.pool()["jobs"]}
    for j in jobs:
        leased = pool[j["job"]]["gpus"]
        assert j["cvd"] == j["lease"] == ",".join(map(str, leased)), j
        assert len(leased) == pool[j["job"]]["need"] == (2 if "gpu_map.gpus_per_rank=2" in
                                                         pool[j["job"]]["overrides"] else 1)
        plan = json.loads((sweep.dir / str(j["job"]) / "result.json").read_text())["plan"]
        assert plan[0]["gpus"] == leased   # expgpu inside the job planned on its lease only
    for a, b in overlapping(jobs):
        assert not gpus_of(a) & gpus_of(b), f"jobs #{a['job']} and #{b['job']} shared a GPU"
    assert most_at_once(jobs) >= 2, "a 2-GPU and a 1-GPU job fit at once on 3 GPUs"
    _all_leases_free(sweep, 3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_sweeps_at_once_never_share_a_gpu(tmp_path):
    one = Sweep(tmp_path, "one")
    two = Sweep(tmp_path, "two", lease_dir=one.lease_dir)
    overrides = ["task=sleep", "task.model.seconds=1.5", "task.model.tag=range(2)", simulate(2)]
    one.start(overrides)
    two.start(overrides)
    a, b = one.wait(), two.wait()
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    jobs = [{**j, "sweep": "one"} for j in windows(one)] + [{**j, "sweep": "two"} for j in windows(two)]
    assert len(jobs) == 4
    assert {j["sweep"] for j in jobs} == {"one", "two"}
    for x, y in overlapping(jobs):
        assert not gpus_of(x) & gpus_of(y), f"{x['sweep']} #{x['job']} and {y['sweep']} #{y['job']} shared a GPU"
    assert most_at_once(jobs) <= 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_failing_job_is_reported_frees_its_gpu_and_the_sweep_goes_on(tmp_path):
    sweep = Sweep(tmp_path)
    # One GPU: the job after a crash can only run if the crashed job's lease was freed.
    done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.fail=kill,raise,''", simulate(1)])
    assert done.returncode == 1, done.stderr
    states = [(j["state"], j["error"]) for j in sweep.pool()["jobs"]]
    assert states[0] == ("failed", "killed by SIGKILL")
    assert states[1][0] == "failed" and "this job fails on purpose" in states[1][1]
    assert states[2] == ("finished", None)
    assert json.loads((sweep.dir / "2" / "result.json").read_text())["plan"][0]["gpus"] == [0]
    # One line per failure (the summary's), then the exit says the sweep did not all succeed.
    for num, why in ((0, "killed by SIGKILL"), (1, "this job fails on purpose")):
        lines = [ln for ln in (done.stdout + done.stderr).splitlines() if f"job #{num} (" in ln and " failed: " in ln
                 and " failed after " not in ln]   # the live event line says when, not why
        assert len(lines) == 1 and why in lines[0], done.stdout + done.stderr
    assert "Error executing job" not in done.stderr and "Traceback" not in done.stderr
    assert "expgpu: the sweep failed (its failed jobs are listed above)" in done.stderr
    assert "this job fails on purpose" in (sweep.dir / "1" / "console.log").read_text()
    _all_leases_free(sweep, 1)
    assert _report(sweep) == [("0", "failed", "GPU 0 (sim)"), ("1", "failed", "GPU 0 (sim)"),
                              ("2", "finished", "GPU 0 (sim)")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_job_and_leaves_no_process_and_no_lease(tmp_path):
    sweep = Sweep(tmp_path)
    sweep.start(["task=sleep", "task.model.seconds=120", "task.model.tag=range(4)", simulate(2),
                 "hydra.launcher.grace_s=2"])
    _wait_for(lambda: len(sweep.records("start")) == 2, 90, sweep)
    pids = [r["pid"] for r in sweep.records("start")]
    assert set(pids) <= set(_processes_of(sweep.proc.pid))
    t = time.monotonic()
    sweep.proc.send_signal(signal.SIGINT)   # what a terminal's Ctrl-C sends to the foreground group
    done = sweep.wait(60)
    assert done.returncode == 130, done.stderr
    assert time.monotonic() - t < 30
    assert "expgpu: interrupted" in done.stderr
    states = sorted(j["state"] for j in sweep.pool()["jobs"])
    assert states == ["not_started", "not_started", "stopped", "stopped"], \
        [(j["state"], j["error"]) for j in sweep.pool()["jobs"]]
    for pid in pids:
        assert not _alive(pid), f"job process {pid} outlived the sweep"
    assert not _processes_of(sweep.proc.pid), "a job process (or a warm spare) outlived the sweep"
    _all_leases_free(sweep, 2)
    assert sorted(status for _, status, _ in _report(sweep)) == ["not_started", "not_started", "stopped", "stopped"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_while_a_large_batch_is_composed_stops_it_there(tmp_path):
    """Composing 3000 jobs takes tens of seconds (the sweeper's check of the batch, then the pool's): a Ctrl-C
    then ends the sweep at the next job's config, not after the last one's, and nothing started or outlives
    it; nor does its exit wait for the interpreter to collect thousands of configs."""
    sweep = Sweep(tmp_path)
    sweep.start(["task=sleep", "task.model.seconds=1", "task.model.tag=range(3000)", simulate(2)])
    _wait_for(lambda: (sweep.dir / STATE).is_dir(), 90, sweep)   # made just before the jobs are composed
    sweep.proc.send_signal(signal.SIGINT)
    done = sweep.wait(60)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == "expgpu: interrupted", done.stderr[-3000:]
    said = r"gpu_pool: SIGINT while (the sweeper checked the batch|composing the batch \(\d+ of 3000 jobs\)): no job"
    assert re.search(said, done.stdout) and "gpu_pool: 3000 jobs on" not in done.stdout, done.stdout[-3000:]
    assert "Traceback" not in done.stderr and not (sweep.dir / "pool.json").exists()
    assert not _processes_of(sweep.proc.pid), "a warm spare or the fork server outlived the sweep"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_launcher_takes_its_jobs_and_leases_with_it(tmp_path):
    sweep = Sweep(tmp_path)
    sweep.start(["task=sleep", "task.model.seconds=120", "task.model.tag=range(2)", simulate(2)])
    _wait_for(lambda: len(sweep.records("start")) == 2, 90, sweep)
    pids = [r["pid"] for r in sweep.records("start")]
    sweep.proc.send_signal(signal.SIGKILL)
    sweep.wait(30)
    _wait_for(lambda: not any(_alive(p) for p in pids), 20)
    _wait_for(lambda: not _processes_of(sweep.proc.pid), 20)
    _all_leases_free(sweep, 2)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_jobs_wait_for_a_gpu_leased_by_someone_else(tmp_path):
    sweep = Sweep(tmp_path)
    gpu = inventory([{"name": "A100", "memory_mb": 40960}], env={})[0]
    theirs = leases.try_acquire(leases.lease_dir(str(sweep.lease_dir)), gpu)
    theirs.note(pid=12345, sweep="another sweep", job=7)
    try:
        # With a time limit: the queued jobs give up, naming who holds the GPU.
        done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.tag=0,1", simulate(1),
                          "hydra.launcher.wait_timeout_s=1"], timeout=60)
        assert done.returncode == 1
        assert "waiting for GPUs leased by others (GPU 0: pid 12345 (job #7 of another sweep))" in done.stdout
        assert [j["state"] for j in sweep.pool()["jobs"]] == ["failed", "failed"]
        assert "hydra.launcher.wait_timeout_s=1s" in sweep.pool()["jobs"][0]["error"]
        # Without one they wait, and start as soon as the GPU is free.
        later = Sweep(tmp_path, "later", lease_dir=sweep.lease_dir)
        later.start(["task=sleep", "task.model.seconds=0", "task.model.tag=0,1", simulate(1)])
        _wait_for(lambda: (later.dir / "pool.json").exists(), 60, later)
        time.sleep(2)
        assert [j["state"] for j in later.pool()["jobs"]] == ["queued", "queued"]
    finally:
        theirs.release()
    done = later.wait(120)
    assert done.returncode == 0, done.stderr
    assert [j["state"] for j in later.pool()["jobs"]] == ["finished", "finished"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_training_jobs_on_a_simulated_pool(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=a,b", "task.max_steps=20", "task.log_every=5", simulate(2)])
    assert done.returncode == 0, done.stderr
    seen = []
    for n in (0, 1):
        result = json.loads((sweep.dir / str(n) / "result.json").read_text())
        assert result["status"] == "finished" and result["steps"] == 20
        assert result["metrics"]["final_loss"] is not None
        assert result["plan"][0]["gpus"] == sweep.pool()["jobs"][n]["gpus"]
        seen.append(result["task"])
        rows = (sweep.dir / str(n) / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 4
    assert seen == ["a", "b"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_log_never_shows_more_jobs_running_than_slots(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=0.3", "task.model.tag=range(6)",
                      "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    shown = [int(n) for n in re.findall(r"running (\d+)", done.stdout)]
    assert len(shown) >= 12, done.stdout   # a line per start and per end
    assert max(shown) == 2, [line for line in done.stdout.splitlines() if "running 3" in line]
    assert "done 6/6, running 0, queued 0" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_job_gets_its_share_of_the_cores_unless_the_user_chose(tmp_path):
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 2)
    # Nobody set OMP_NUM_THREADS: 2 slots share the cores.
    sweep = Sweep(tmp_path, "budget", OMP_NUM_THREADS=None, MKL_NUM_THREADS=None)
    done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.tag=range(4)", "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert f"{share} thread{'s' if share > 1 else ''} per job ({cores} cores, 2 jobs at once" in done.stdout
    seen = {(r["omp"], r["mkl"], r["blas"], r["torch_threads"]) for r in sweep.records()}
    assert seen == {(str(share), str(share), str(share), share)}, seen
    # hydra.launcher.threads_per_job decides
    chosen = Sweep(tmp_path, "chosen", OMP_NUM_THREADS=None)
    done = chosen.run(["task=sleep", "task.model.seconds=0", "task.model.tag=range(2)", "hydra.launcher.cpu_slots=2",
                       "hydra.launcher.threads_per_job=3"])
    assert done.returncode == 0, done.stderr
    assert "3 threads per job (hydra.launcher.threads_per_job)" in done.stdout
    assert {(r["omp"], r["torch_threads"]) for r in chosen.records()} == {("3", 3)}
    # The user's own OMP_NUM_THREADS is kept
    theirs = Sweep(tmp_path, "theirs", OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS=None)
    done = theirs.run(["task=sleep", "task.model.seconds=0", "task.model.tag=range(2)", "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert "threads per job as set (OMP_NUM_THREADS=2)" in done.stdout
    assert {(r["omp"], r["torch_threads"]) for r in theirs.records()} == {("2", 2)}
    # OPENBLAS_NUM_THREADS alone (numpy's) is kept, and does not stand for torch's threads
    blas = Sweep(tmp_path, "blas", OMP_NUM_THREADS=None, MKL_NUM_THREADS=None, OPENBLAS_NUM_THREADS="7")
    done = blas.run(["task=sleep", "task.model.seconds=0", "task.model.tag=range(2)", "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert {(r["omp"], r["blas"], r["torch_threads"]) for r in blas.records()} == {(str(share), "7", share)}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_task_module_is_imported_once_per_sweep_ahead_of_the_jobs_without_starting_cuda(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=0.5", "task.model.tag=range(4)", simulate(2)])
    assert done.returncode == 0, done.stderr
    imported = {r["pid"]: r["job"] for r in sweep.records("import")}
    jobs = sweep.records()
    assert len(jobs) == 4
    # The task's module was imported once for the whole sweep, by a process without a job (-1): the
    # fork server every job's process is forked from. No job imported it again...
    assert list(imported.values()) == [-1], imported
    assert not any(j["pid"] in imported for j in jobs), (imported, [j["pid"] for j in jobs])
    # ...and CUDA was not started by it: each job's mask (set at hand-over) still counts.
    assert not any(j["cuda_initialized"] for j in jobs)
    assert {j["cvd"] for j in jobs} <= {"0", "1"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_without_the_fork_server_jobs_still_run_in_processes_started_one_by_one(tmp_path):
    # A task module that starts a thread when imported: the fork server (which imports it ahead on
    # CPU slots) must not fork with it, and the pool starts each job's process itself instead.
    sweep = Sweep(tmp_path)
    (sweep.code / "threaded_task.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
        "from pool_task import Sleep  # noqa\n")
    done = sweep.run(["task=sleep", "task.model._target_=threaded_task.Sleep", "task.model.seconds=0",
                      "task.model.tag=range(4)", "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert [j["state"] for j in sweep.pool()["jobs"]] == ["finished"] * 4
    assert sorted(r["tag"] for r in sweep.records()) == [0, 1, 2, 3]
    assert "not forking" in (sweep.dir / ".expgpu" / "pool-spares.log").read_text()

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_jobs_atexit_handlers_run_in_every_job(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.at_exit=write", "task.model.tag=range(6)",
                      "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert sorted(r["tag"] for r in sweep.records("atexit")) == list(range(6)), "atexit ran in 6 of 6 jobs"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hanging_atexit_handler_is_cut_after_the_grace_and_named(tmp_path):
    sweep = Sweep(tmp_path, EXPGPU_ATEXIT_GRACE_S="1")
    t = time.monotonic()
    done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.at_exit=hang", "task.model.tag=0,1"], 100)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t < 60
    assert [j["state"] for j in sweep.pool()["jobs"]] == ["finished", "finished"]
    for n in (0, 1):
        console = (sweep.dir / str(n) / "console.log").read_text()
        assert "expgpu: atexit handler pool_task.hang_forever (" in console, console
        assert "did not return within 1s (EXPGPU_ATEXIT_GRACE_S); exiting without it" in console


@pytest.mark.slow
@pytest.mark.parametrize("pool", [True, False], ids=["gpu_pool", "nproc_per_node"])
def test_a_bad_atexit_grace_is_one_line_before_anything_starts(tmp_path, pool):
    sweep = Sweep(tmp_path, EXPGPU_ATEXIT_GRACE_S="ten")
    if pool:
        done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.tag=0,1"], 60)
    else:
        done = expgpu(["task=a", "task.max_steps=5", "launch.nproc_per_node=2"], tmp_path / "run",
                      env=clean_env(EXPGPU_ATEXIT_GRACE_S="ten"), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "EXPGPU_ATEXIT_GRACE_S='ten' is not allowed: seconds >= 0" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.rglob("result.json")), "nothing ran"


START_CALLBACK = '''
import json, os
from hydra.experimental.callback import Callback


class SeeStart(Callback):
    def on_job_start(self, config, **kwargs):
        with open(os.environ["POOL_TEST_LOG"], "a") as f:
            f.write(json.dumps({"event": "on_job_start", "job": int(os.environ.get("EXPGPU_POOL_JOB", "-1")),
                                "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_jobs_after_the_first_wave_are_primed_and_get_their_gpus_env_set_and_config(tmp_path):
    # A primed spare did Hydra's set-up of its job (run_job up to the task function) while the first
    # wave ran; at the hand-over it still gets the job's own GPUs and leases, and the job's
    # hydra.job.env_set still wins over the pool's variables.
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=2", "task.model.tag=range(4)", simulate(2),
                      "hydra.launcher.threads_per_job=1", "+hydra.job.env_set.MKL_NUM_THREADS=5"])
    assert done.returncode == 0, done.stderr
    pool = {j["num"]: j for j in sweep.pool()["jobs"]}
    by_start = sorted(pool.values(), key=lambda j: j["started"])
    assert [j["primed"] for j in by_start] == [False, False, True, True], by_start
    for r in sweep.records():
        job = pool[r["job"]]
        assert r["cvd"] == r["lease"] == ",".join(map(str, job["gpus"])), (r, job)
        assert (r["omp"], r["mkl"], r["torch_threads"]) == ("1", "5", 1), r
        assert (sweep.dir / str(r["job"]) / ".hydra" / "overrides.yaml").read_text().count(f"task.model.tag={r['tag']}")
        assert json.loads((sweep.dir / str(r["job"]) / "result.json").read_text())["status"] == "finished"
    assert sorted(r["tag"] for r in sweep.records()) == [0, 1, 2, 3]
    _all_leases_free(sweep, 2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_users_on_job_start_callback_turns_priming_off(tmp_path):
    # Its on_job_start must see the job as started: its own job number and GPUs, not a spare's.
    sweep = Sweep(tmp_path)
    (sweep.code / "start_callback.py").write_text(START_CALLBACK)
    done = sweep.run(["task=sleep", "task.model.seconds=1", "task.model.tag=range(4)", simulate(2),
                      "+hydra.callbacks.see._target_=start_callback.SeeStart"])
    assert done.returncode == 0, done.stderr
    pool = {j["num"]: j for j in sweep.pool()["jobs"]}
    assert not any(j["primed"] for j in pool.values())
    seen = sweep.records("on_job_start")
    assert sorted(r["job"] for r in seen) == [0, 1, 2, 3]
    for r in seen:
        assert r["cvd"] == ",".join(map(str, pool[r["job"]]["gpus"])), r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pool_json_keeps_every_launch_batch_in_order(tmp_path, hydra_optuna):
    # Hydra's optuna sweeper with n_jobs=1 calls launch() once per trial: 3 batches of 1 job each.
    sweep = Sweep(tmp_path)
    sweep.env = with_path(sweep.env, hydra_optuna)
    done = sweep.run(["task=a", "task.max_steps=5", "objective=final_loss", "hydra/sweeper=optuna",
                      "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1", "hydra.sweeper.sampler.seed=0",
                      "task.optimizer.lr=interval(0.001,0.1)", "hydra.launcher.cpu_slots=2"], 280)
    assert done.returncode == 0, done.stderr[-3000:]
    pool = sweep.pool()
    assert [j["num"] for j in pool["jobs"]] == [0, 1, 2]
    assert [j["state"] for j in pool["jobs"]] == ["finished"] * 3
    assert pool["batches"] == [{"batch": 0, "jobs": [0]}, {"batch": 1, "jobs": [1]}, {"batch": 2, "jobs": [2]}]
    assert [Path(j["dir"]).name for j in pool["jobs"]] == ["0", "1", "2"]
    assert [row[1] for row in _report(sweep)] == ["finished"] * 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_optimizing_sweep_warms_one_fork_server_for_all_its_batches(tmp_path, hydra_optuna):
    # Hydra's optuna sweeper with n_jobs=1: one launch() per trial. The task's module (and torch) is
    # imported once, by one fork server kept from batch to batch, not once per trial; and it is gone at the end.
    sweep = Sweep(tmp_path)
    sweep.env = with_path(sweep.env, hydra_optuna)
    done = sweep.run(["task=sleep", "task.model.seconds=0", "objective=final_loss", "hydra/sweeper=optuna",
                      "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1", "hydra.sweeper.sampler.seed=0",
                      "task.optimizer.lr=interval(0.001,0.1)", "hydra.launcher.cpu_slots=2"], 280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [b["jobs"] for b in sweep.pool()["batches"]] == [[0], [1], [2]]
    assert [r["job"] for r in sweep.records("import")] == [-1], sweep.records("import")
    assert len(sweep.records()) == 3
    # the kept server's state is tidied when the sweep ends; the sweep's process record stays (expgpu.status.busy)
    assert sorted(p.name for p in (sweep.dir / ".expgpu").iterdir()) == ["process.json", "process.lock"]


@pytest.mark.parametrize("override, message", [
    ("hydra.launcher.gpus=[7]", "hydra.launcher.gpus: GPU 7 is not on this machine; allowed: all, or a list of 0, 1"),
    ("hydra.launcher.cpu_slots=0", "hydra.launcher.cpu_slots=0 is not allowed: an integer >= 1"),
    ("hydra.launcher.gpus=[0,0]", "hydra.launcher.gpus=[0, 0]: a GPU is listed twice"),
    ("launch.nproc_per_node=3", "needs 3 GPUs (launch.nproc_per_node x gpu_map.gpus_per_rank), but the pool has 2"),
    ("hydra.launcher.gpus_per_job=-1", "hydra.launcher.gpus_per_job=-1 is not allowed: an integer >= 0 or null"),
    ("hydra.launcher.threads_per_job=0", "hydra.launcher.threads_per_job=0 is not allowed: an integer >= 1 or null"),
    ("hydra.launcher.max_requeues=-1", "hydra.launcher.max_requeues=-1 is not allowed: an integer >= 0"),
    ("hydra.launcher.timeout_min=-1", "hydra.launcher.timeout_min=-1.0 is not allowed: minutes > 0 (e.g. 90 or 0.5), "
                                      "or 0 or null for no limit"),
])
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_bad_launcher_settings_are_one_line_errors(tmp_path, override, message):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.tag=0,1", simulate(2), override], timeout=60)
    assert done.returncode == 2, done.stderr
    assert "expgpu: error: " in done.stderr and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not sweep.records("start"), "no job may start"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_gpu_listed_where_there_is_none_is_one_line(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.tag=0,1", "inventory.simulate=[]", "hydra.launcher.gpus=[3]"],
                     timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("expgpu: error: hydra.launcher.gpus: GPU 3 is not on this machine, "
                                                    "which shows no GPU; allowed: all (here: the CPU slots)")
    assert not sweep.records("start"), "no job may start"


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_real_gpus_one_job_per_gpu(tmp_path):
    n = len(inventory(env={}))
    sweep = Sweep(tmp_path, lease_dir=tmp_path / "gpu-leases")
    done = sweep.run(["task=a,b,digits", "task.max_steps=50", "task.optimizer.lr=1e-3,1e-2"], timeout=280)
    assert done.returncode == 0, done.stderr
    jobs = sweep.pool()["jobs"]
    assert len(jobs) == 6
    spans = []
    for j in jobs:
        result = json.loads((Path(j["dir"]) / "result.json").read_text())
        assert result["plan"][0]["device"].startswith("cuda")
        assert result["plan"][0]["gpus"] == j["gpus"] and len(j["gpus"]) == 1
        spans.append({"t0": j["started"], "t1": j["ended"], "cvd": ",".join(map(str, j["gpus"])), "job": j["num"]})
    for a, b in overlapping(spans):
        assert not gpus_of(a) & gpus_of(b)
    if n > 1:
        assert most_at_once(spans) >= 2


# ---------------------------------------------------------------------------------------------

def _wait_for(cond, timeout: float, sweep: Sweep | None = None) -> None:
    """Until cond(); with a sweep, fail at once if it ended first."""
    deadline = time.monotonic() + timeout
    while not cond():
        if sweep is not None and sweep.proc.poll() is not None and not cond():
            out, err = sweep.proc.communicate()
            pytest.fail(f"the sweep ended early ({sweep.proc.returncode}): {err[-2000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _report(sweep: Sweep) -> list[tuple[str, str, str]]:
    """(job, status, devices) per row of `python -m expgpu.report` on the sweep dir."""
    done = subprocess.run([sys.executable, "-m", "expgpu.report", str(sweep.dir), "--no-plot"], env=sweep.env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with open(sweep.dir / "report.csv", newline="") as f:
        return [(r["job"], r["status"], r["devices"]) for r in csv.DictReader(f)]


def _processes_of(launcher: int) -> list[int]:
    """Live processes the launcher started for its jobs (they carry its pid in their environment)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "expgpu.pool.job_process" in (p.info["cmdline"] or []) and \
                    p.environ().get("EXPGPU_POOL_PARENT") == str(launcher) and _alive(p.pid):
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _all_leases_free(sweep: Sweep, n: int) -> None:
    gpus = inventory([{"name": "A100", "memory_mb": 40960}] * n, env={})
    deadline = time.monotonic() + 10
    while any(leases.holder(sweep.lease_dir, g) for g in gpus):
        assert time.monotonic() < deadline, [leases.holder(sweep.lease_dir, g) for g in gpus]
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_stuck_past_its_time_limit_is_killed_after_the_grace_and_named(tmp_path):
    # job 1 sleeps in its model's constructor, before any step: the SIGTERM at its limit is kept for the loop,
    # which it never reaches, so the SIGKILL grace_s later ends it
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=0,120", "hydra.launcher.cpu_slots=2",
                      "hydra.launcher.timeout_min=0.1", "hydra.launcher.grace_s=2"], 100)
    assert done.returncode == 1, done.stderr[-3000:]
    jobs = {j["num"]: j for j in sweep.pool()["jobs"]}
    assert jobs[0]["state"] == "finished" and jobs[1]["state"] == "failed", jobs
    assert jobs[1]["error"] == "ran past hydra.launcher.timeout_min=0.1 (6 s) (killed by SIGKILL)", jobs[1]
    assert 6 + 2 <= jobs[1]["wall_s"] < 6 + 2 + 10, jobs[1]
    assert not _processes_of(sweep.proc.pid) and not _alive(jobs[1]["pid"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_keys_read_inside_an_allocation_only_say_so_once_on_a_workstation_and_the_sweep_runs(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.tag=0,1", simulate(2), "hydra.launcher.max_requeues=2",
                      "hydra.launcher.warm_starts=false"], timeout=100)
    assert done.returncode == 0, done.stderr
    said = [line for line in (done.stdout + done.stderr).splitlines() if "read inside a SLURM allocation only" in line]
    assert len(said) == 1 and said[0].endswith(
        "gpu_pool: hydra.launcher.max_requeues=2, hydra.launcher.warm_starts=false: read inside a SLURM allocation "
        "only (salloc, sbatch); this sweep runs on this machine, where it changes nothing"), done.stdout
