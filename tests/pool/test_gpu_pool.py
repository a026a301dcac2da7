"""hydra/launcher=gpu_pool: parallel sweeps, one job per leased GPU or CPU slot: which job runs where and
when, failures, Ctrl-C, leases held by others, time limits and bad settings.

The tests run a tiny task whose model sleeps a known time and records what its process saw
(tests/helpers/pool_sweep.py); one test runs real training jobs. All run the real CLI in real processes;
GPUs are simulated (inventory.simulate) except in the test marked gpu. What each job's process is
(threads, the fork server, atexit, priming): test_pool_jobs.py.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from pool_sweep import (
    Sweep,
    alive,
    all_leases_free,
    gpus_of,
    most_at_once,
    overlapping,
    processes_of,
    report_rows,
    runs,
    simulate,
    wait_for,
    windows,
)

from expgpu.gpus import inventory
from expgpu.pool import leases
from expgpu.rundir import STATE


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
    all_leases_free(sweep, 3)


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
    assert states[0] == ("failed", "killed by SIGKILL (not by expgpu: kill -9, a scheduler, or the kernel's OOM "
                                   "killer)")
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
    all_leases_free(sweep, 1)
    assert report_rows(sweep) == [("0", "failed", "GPU 0 (sim)"), ("1", "failed", "GPU 0 (sim)"),
                              ("2", "finished", "GPU 0 (sim)")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_job_and_leaves_no_process_and_no_lease(tmp_path):
    sweep = Sweep(tmp_path)
    sweep.start(["task=sleep", "task.model.seconds=120", "task.model.tag=range(4)", simulate(2),
                 "hydra.launcher.grace_s=2"])
    wait_for(lambda: len(sweep.records("start")) == 2, 90, sweep)
    pids = [r["pid"] for r in sweep.records("start")]
    assert set(pids) <= set(processes_of(sweep.proc.pid))
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
        assert not alive(pid), f"job process {pid} outlived the sweep"
    assert not processes_of(sweep.proc.pid), "a job process (or a warm spare) outlived the sweep"
    all_leases_free(sweep, 2)
    assert sorted(status for _, status, _ in report_rows(sweep)) == ["not_started", "not_started", "stopped", "stopped"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_while_a_large_batch_is_composed_stops_it_there(tmp_path):
    """Composing 3000 jobs takes tens of seconds (the sweeper's check of the batch, then the pool's): a Ctrl-C
    then ends the sweep at the next job's config, not after the last one's, and nothing started or outlives
    it; nor does its exit wait for the interpreter to collect thousands of configs."""
    sweep = Sweep(tmp_path)
    sweep.start(["task=sleep", "task.model.seconds=1", "task.model.tag=range(3000)", simulate(2)])
    wait_for(lambda: (sweep.dir / STATE).is_dir(), 90, sweep)   # made just before the jobs are composed
    sweep.proc.send_signal(signal.SIGINT)
    done = sweep.wait(60)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == "expgpu: interrupted", done.stderr[-3000:]
    said = r"gpu_pool: SIGINT while (the sweeper checked the batch|composing the batch \(\d+ of 3000 jobs\)): no job"
    assert re.search(said, done.stdout) and "gpu_pool: 3000 jobs on" not in done.stdout, done.stdout[-3000:]
    assert "Traceback" not in done.stderr and not (sweep.dir / "pool.json").exists()
    assert not processes_of(sweep.proc.pid), "a warm spare or the fork server outlived the sweep"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_launcher_takes_its_jobs_and_leases_with_it(tmp_path):
    sweep = Sweep(tmp_path)
    sweep.start(["task=sleep", "task.model.seconds=120", "task.model.tag=range(2)", simulate(2)])
    wait_for(lambda: len(sweep.records("start")) == 2, 90, sweep)
    pids = [r["pid"] for r in sweep.records("start")]
    sweep.proc.send_signal(signal.SIGKILL)
    sweep.wait(30)
    wait_for(lambda: not any(alive(p) for p in pids), 20)
    wait_for(lambda: not processes_of(sweep.proc.pid), 20)
    all_leases_free(sweep, 2)


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
        wait_for(lambda: (later.dir / "pool.json").exists(), 60, later)
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
    # in the order it happened: on each slot a job's end, then the start of the next one in its place (the
    # round starts it before it reads how the ended job went)
    by_slot: dict[str, list[str]] = {}
    for what, slot in re.findall(r"#\d+ (started|finished) (?:in \S+ )?on cpu slot (\d)", done.stdout):
        by_slot.setdefault(slot, []).append(what)
    assert sorted(by_slot) == ["0", "1"] and all(
        seq == ["started", "finished"] * (len(seq) // 2) for seq in by_slot.values()), by_slot


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
    ("hydra.launcher.jobs_per_gpu=0", "hydra.launcher.jobs_per_gpu=0 is not allowed: an integer >= 1"),
    ("+hydra.launcher.gpu=1", "hydra.launcher.gpu: unknown key; allowed under hydra.launcher: _target_, gpus, "
                              "gpus_per_job"),   # added with +, it would be read by nothing
    ("+launch.backend=gloo", "launch.backend: unknown key; allowed under launch: nproc_per_node"),   # each job's
    ("hydra.launcher.jobs_per_gpu=2 hydra.launcher.gpus_per_job=0",   # it would change nothing: said, not ignored
     "hydra.launcher.jobs_per_gpu=2 shares GPUs, and hydra.launcher.gpus_per_job=0 puts every job on a CPU slot"),
    ("hydra.launcher.gpus_per_job=2 hydra.launcher.jobs_per_gpu=4 hydra.launcher.gpus=[0]",
     "needs 2 GPUs (hydra.launcher.gpus_per_job), but the pool has 1 (0)"),   # a job's shares: on different GPUs
])
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_bad_launcher_settings_are_one_line_errors(tmp_path, override, message):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.tag=0,1", simulate(2), *override.split()], timeout=60)
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
    assert not processes_of(sweep.proc.pid) and not alive(jobs[1]["pid"])


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
