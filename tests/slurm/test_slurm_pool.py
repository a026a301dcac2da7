"""hydra/launcher=slurm_pool on the real 2-node local cluster (expgpu.slurm.sweep_job): a whole sweep or study as
one SLURM job, followed from the submitting terminal, or detached and followed again; its dry run; bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import slurm_cluster_2n  # noqa: F401

from conftest import HELPERS, PACED, REPO, clean_env, pythonpath, wait_until
from expgpu import results

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SWEEP = ["hydra/launcher=slurm_pool", "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=4",
         "hydra.launcher.timeout_min=10", "task=a", "task.max_steps=20", "logger=none"]


def _run(cluster, args: list[str], sweep: Path, timeout: float = 300, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep}"], cwd=sweep.parent,
                          env=env or cluster.env, capture_output=True, text=True, timeout=timeout)


def _job(sweep: Path) -> dict:
    return json.loads((sweep / ".slurm_pool" / "job.json").read_text())


@pytest.mark.timeout(400)
def test_a_sweep_is_one_slurm_job_followed_to_its_end(slurm_cluster_2n, tmp_path):
    sweep = tmp_path / "sweep"
    done = _run(slurm_cluster_2n, [*SWEEP, "task.seed=range(4)", "gpu_map.gpus_per_rank=1,2", "launch.nodes=1,2"],
                sweep)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    job = _job(sweep)
    assert (f"slurm_pool: the sweep is SLURM job {job['job_id']} (2 whole node(s), each with all its GPUs (at least "
            "4))") in done.stdout
    assert "asks for whole nodes" not in done.stderr   # they have 4 GPUs each: no more than it asked for
    assert "gpu_pool: done 16/16" in done.stdout   # the pool's board, followed from the allocation's output
    pool = json.loads((sweep / "pool.json").read_text())
    assert pool["allocation"]["job_id"] == job["job_id"]   # one SLURM job ran every trial
    assert [j["state"] for j in pool["jobs"]] == ["finished"] * 16
    assert {n for j in pool["jobs"] for n in j["nodes"]} == set(slurm_cluster_2n.nodes)
    assert (sweep / "report.html").exists() and (sweep / ".slurm_pool" / f"exit-{job['job_id']}").read_text() == "0\n"


@pytest.mark.timeout(400)
def test_without_gpus_a_sweep_is_one_slurm_job_on_cpu_slots(slurm_cluster_2n, tmp_path):
    sweep = tmp_path / "sweep"
    cpu = [a for a in SWEEP if "gpus_per_node" not in a]
    done = _run(slurm_cluster_2n, [*cpu, "hydra.launcher.gpus_per_node=0", "hydra.launcher.pool.cpu_slots=2",
                                   "task.seed=range(4)"], sweep)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    job = _job(sweep)
    assert f"slurm_pool: the sweep is SLURM job {job['job_id']} (2 node(s) x 2 CPU slot(s))" in done.stdout
    assert "--gres" not in (sweep / ".slurm_pool" / "allocation.sbatch").read_text()
    # the local nodes have 4 (fake) GPUs each, which whole nodes come with
    assert ("slurm_pool: warning: gpus_per_node=0 asks for whole nodes (--exclusive) of partition debug, whose "
            "nodes have up to 4 GPU(s)") in done.stderr, done.stderr[-3000:]
    pool = json.loads((sweep / "pool.json").read_text())
    assert pool["allocation"]["job_id"] == job["job_id"] and pool["allocation"]["cpu_slots_per_node"] == 2
    assert [j["state"] for j in pool["jobs"]] == ["finished"] * 4


def _progress(run_dir: Path) -> int:
    """The last step run_dir's metrics.jsonl holds (0: none yet)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def _cut_mid_sweep(args: list[str], cwd: Path, env: dict, sweep: Path, short: tuple, steps: int, cut):
    """Follow a slurm_pool sweep; once the `short` jobs have finished and job 0 has trained `steps` steps,
    `cut(job id)` its allocation; (the job id, the follower's output) after it ended with 0."""
    follower = subprocess.Popen([sys.executable, "-m", "expgpu", "-m", *args], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(f"jobs {short} finished while job 0 trains", lambda: all(
            (results.read_result(sweep / str(n)) or {}).get("status") == "finished" for n in short)
            and _progress(sweep / "0") >= steps, timeout=240, every=0.5)
        job = _job(sweep)["job_id"]
        cut(job)
        out, _ = follower.communicate(timeout=400)
    finally:
        follower.kill()
    assert follower.returncode == 0, out[-5000:]
    return job, out


@pytest.mark.timeout(500)
@pytest.mark.parametrize("how", ["USR2 before the time limit", "scontrol requeue"])
def test_requeued_mid_sweep_it_keeps_finished_jobs_and_resumes_the_cut_one(slurm_cluster_2n, tmp_path, how):
    """The allocation ends mid-sweep, the ways SLURM ends it, and runs again: the two short jobs that finished are
    not started again, the long one cut mid-training resumes from its checkpoint, and the sweep ends with 0.
    SIGUSR2 (what --signal=B:USR2@N sends the batch shell before the time limit): the sweep requeues itself.
    `scontrol requeue` (as a preemption with PreemptMode=REQUEUE): SIGTERM, and SLURM requeues it."""
    sweep = tmp_path / "sweep"
    args = ["hydra/launcher=slurm_pool", "hydra.launcher.nodes=1", "hydra.launcher.gpus_per_node=2",
            "hydra.launcher.timeout_min=10", "task=a", "logger=none", "task.log_every=5", "backend.timeout_s=60",
            PACED, "task.max_steps=5000,20,20", f"hydra.sweep.dir={sweep}"]
    finished_at = {}

    def cut(job: str) -> None:
        finished_at.update({n: (sweep / str(n) / "result.json").stat().st_mtime_ns for n in (1, 2)})
        slurm_cluster_2n.run(["scontrol", "requeue", job] if how == "scontrol requeue"
                             else ["scancel", "--signal=USR2", "--batch", job])

    job, out = _cut_mid_sweep(args, tmp_path, slurm_cluster_2n.env, sweep, (1, 2), 100, cut)
    assert f"slurm_pool: job {job} requeued: the sweep goes on in the same sweep dir" in out, out[-5000:]
    if how != "scontrol requeue":
        assert f"gpu_pool: requeued SLURM job {job} (1 of at most 3)" in out, out[-5000:]
    pool = json.loads((sweep / "pool.json").read_text())
    assert pool["allocation"]["job_id"] == job
    assert [(j["num"], j["state"], j["kept"]) for j in pool["jobs"]] == [
        (0, "finished", False), (1, "finished", True), (2, "finished", True)]
    assert {n: (sweep / str(n) / "result.json").stat().st_mtime_ns for n in (1, 2)} == finished_at
    long = results.read_result(sweep / "0")
    assert long["status"] == "finished" and 0 < long["resumed_from_step"] < long["steps"] == 5000, long
    assert (sweep / ".slurm_pool" / f"exit-{job}").read_text() == "0\n"


@pytest.mark.timeout(500)
def test_a_study_requeued_mid_way_continues_from_its_journal_to_exactly_n_trials(slurm_cluster_2n, tmp_path):
    """Trial 0 trains slowly while trials 1-3 finish beside it; SLURM's warning before the time limit requeues the
    allocation; run again, the study goes on from its journal: trial 0 resumes from its checkpoint, no trial is
    asked twice or run again, and the study ends with exactly n_trials, all complete."""
    sweep = tmp_path / "study"
    args = ["--config-dir", str(REPO / "tests" / "conf"), "task=tune_probe", "objective=score",
            "hydra/sweeper=expgpu_optuna", "hydra.sweeper.sampler.seed=0", "task.x=interval(0,1)",
            "hydra.sweeper.n_trials=4", "task.max_steps=400", "task.slow_step_s=0.25", "hydra/launcher=slurm_pool",
            "hydra.launcher.nodes=1", "hydra.launcher.gpus_per_node=2", "logger=none", f"hydra.sweep.dir={sweep}"]
    env = {**slurm_cluster_2n.env, "PYTHONPATH": pythonpath(HELPERS)}
    job, out = _cut_mid_sweep(args, tmp_path, env, sweep, (1, 2, 3), 20, lambda job: slurm_cluster_2n.run(
        ["scancel", "--signal=USR2", "--batch", job]))
    assert f"gpu_pool: requeued SLURM job {job} (1 of at most 3)" in out, out[-5000:]
    assert "3 trial(s) done, 1 to go (1 of them resumed from their job dirs)" in out, out[-5000:]
    study = json.loads((sweep / "study.json").read_text())
    assert [(t["number"], t["state"]) for t in study["trials"]] == [(n, "COMPLETE") for n in range(4)], study
    slow = results.read_result(sweep / "0")
    assert slow["status"] == "finished" and 0 < slow["resumed_from_step"] < slow["steps"] == 400, slow
    pool = json.loads((sweep / "pool.json").read_text())
    assert sorted((j["num"], j["state"]) for j in pool["jobs"]) == [(n, "finished") for n in range(4)]
    assert (sweep / "optimization_results.yaml").exists()


@pytest.mark.timeout(400)
def test_a_job_past_the_pools_time_limit_is_stopped_saves_and_fails_while_the_allocation_goes_on(slurm_cluster_2n,
                                                                                               tmp_path):
    """hydra.launcher.pool.timeout_min is each job's limit inside the allocation (hydra.launcher.timeout_min is the
    allocation's): job 1's 2000 paced steps (64 ms each) outlast 30 s; it gets SIGTERM through SLURM, saves, and
    fails naming the key; job 0 and the allocation finish, and the sweep's exit code says a job failed."""
    sweep = tmp_path / "sweep"
    done = _run(slurm_cluster_2n, ["hydra/launcher=slurm_pool", "hydra.launcher.nodes=1",
                                   "hydra.launcher.gpus_per_node=2", "hydra.launcher.timeout_min=10",
                                   "hydra.launcher.pool.timeout_min=0.5", "task=a", "logger=none", "task.log_every=5",
                                   "task.max_steps=20,2000", "faults.device_ms_per_example=1.0"], sweep)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert "failed: ran past hydra.launcher.timeout_min=0.5 (30 s)" in done.stdout, out[-4000:]
    # 2 GPUs asked for on a whole node (no cpus_per_node: --exclusive): SLURM gives all 4, and the sweep uses them
    assert ("slurm_pool: gpus_per_node=2 asks for whole nodes (--exclusive) of partition debug, whose nodes have up "
            "to 4 GPU(s): SLURM gives them all to the allocation, and the sweep runs its jobs on every one"
            ) in done.stderr, out[-4000:]
    assert re.search(r"gpu_pool: 2 jobs on SLURM job \d+: 1 node\(s\) \(\S+\) x 4 GPU\(s\)", done.stdout), out[-4000:]
    pool = {j["num"]: j for j in json.loads((sweep / "pool.json").read_text())["jobs"]}
    assert (pool[0]["state"], pool[1]["state"]) == ("finished", "failed"), pool
    assert 30 <= pool[1]["wall_s"] < 30 + 15, pool[1]   # it saved and ended on the SIGTERM, not at the SIGKILL
    result = results.read_result(sweep / "1")
    assert (result["status"], result["stop_signal"]) == ("stopped", "SIGTERM") and result["steps"] < 2000, result
    assert (sweep / "1" / "checkpoint.pt").exists()
    assert (sweep / ".slurm_pool" / f"exit-{_job(sweep)['job_id']}").read_text() == "1\n"


@pytest.mark.timeout(400)
def test_detached_it_says_how_to_follow_and_following_again_ends_with_the_sweeps_code(slurm_cluster_2n, tmp_path):
    sweep = tmp_path / "sweep"
    done = _run(slurm_cluster_2n, [*SWEEP, "task.seed=0,1", "hydra.launcher.detach=true"], sweep, timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"slurm_pool: detached. Follow it: python -m expgpu.slurm.sweep_job {sweep}" in done.stdout
    again = subprocess.run([sys.executable, "-m", "expgpu.slurm.sweep_job", str(sweep)], env=slurm_cluster_2n.env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "gpu_pool: done 2/2" in again.stdout
    assert all(json.loads((sweep / str(n) / "result.json").read_text())["status"] == "finished" for n in (0, 1))


@pytest.mark.timeout(300)
def test_a_second_sweep_into_the_dir_of_one_still_in_the_queue_is_refused(slurm_cluster_2n, tmp_path):
    """Its allocation runs on another node, out of expgpu.status.busy's sight: SLURM's queue says it is live."""
    sweep = tmp_path / "sweep"
    later = [*SWEEP, "task.seed=0,1", "hydra.launcher.detach=true",
             "+hydra.launcher.additional_parameters.begin=now+600"]   # pending for 10 min
    first = _run(slurm_cluster_2n, later, sweep, timeout=60)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    job = _job(sweep)["job_id"]
    multirun = (sweep / "multirun.yaml").read_bytes()
    for args in ([*SWEEP, "task.seed=0,1"], [*SWEEP, "task.seed=5", "hydra/sweeper=expgpu_optuna"]):
        twice = _run(slurm_cluster_2n, args, sweep, timeout=60)
        assert twice.returncode == 2, (twice.stdout + twice.stderr)[-4000:]
        assert (f"hydra.sweep.dir={sweep}: its sweep is SLURM job {job}, still PENDING (BeginTime); two sweeps in one "
                f"dir would overwrite" in twice.stderr), twice.stderr
        assert "Traceback" not in twice.stderr
        assert _job(sweep)["job_id"] == job and (sweep / "multirun.yaml").read_bytes() == multirun   # untouched
    # expgpu status shows the allocation while SLURM queues it (the sweep has no job dir yet)
    status = subprocess.run([sys.executable, "-m", "expgpu.status", str(sweep)], env=slurm_cluster_2n.env,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[1].split() == ["queued", "SLURM", "job", job, "the", "sweep's", "allocation:",
                                                     "pending", "-", "-", "-", str(sweep / ".slurm_pool")]
    subprocess.run(["scancel", job], env=slurm_cluster_2n.env, check=True, timeout=30)
    wait_until(f"job {job} to leave the queue", lambda: subprocess.run(
        ["squeue", "-h", "-j", job], env=slurm_cluster_2n.env, capture_output=True, text=True).stdout.strip() == "",
        timeout=60)
    status = subprocess.run([sys.executable, "-m", "expgpu.status", str(sweep)], env=slurm_cluster_2n.env,
                            capture_output=True, text=True, timeout=60)
    assert status.stdout.splitlines()[1].split()[:4] == ["sweep:", "empty", "0", "jobs"], status.stdout
    # gone from the queue: the same command submits again (and is cancelled here)
    third = _run(slurm_cluster_2n, later, sweep, timeout=60)
    assert third.returncode == 0, (third.stdout + third.stderr)[-4000:]
    assert _job(sweep)["job_id"] != job
    subprocess.run(["scancel", _job(sweep)["job_id"]], env=slurm_cluster_2n.env, timeout=30)


@pytest.mark.timeout(400)
def test_an_optimizing_study_runs_inside_the_allocation_trials_beside_each_other_pruned_ones_too(slurm_cluster_2n,
                                                                                                tmp_path):
    sweep = tmp_path / "study"
    args = ["--config-dir", str(REPO / "tests" / "conf"), "task=tune_probe", "objective=score",
            "hydra/sweeper=expgpu_optuna", "hydra.sweeper.sampler.seed=0", "task.x=interval(0,1)",
            "hydra.sweeper.n_trials=8", "hydra.sweeper.pruner={_target_:optuna.pruners.ThresholdPruner,upper:0.5,"
            "n_warmup_steps:2}", "hydra/launcher=slurm_pool", "hydra.launcher.nodes=2",
            "hydra.launcher.gpus_per_node=2", "logger=none"]
    env = {**slurm_cluster_2n.env, "PYTHONPATH": pythonpath(HELPERS)}
    done = _run(slurm_cluster_2n, args, sweep, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    pool = json.loads((sweep / "pool.json").read_text())
    assert pool["allocation"]["job_id"] == _job(sweep)["job_id"] and len(pool["jobs"]) == 8   # n_trials, no more
    states = [j["state"] for j in pool["jobs"]]
    assert states.count("finished") == 8 and "pruned" in (sweep / "report.html").read_text()
    spans = [(j["started"], j["ended"]) for j in pool["jobs"]]
    assert max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans) >= 2, "trials ran side by side"
    assert (sweep / "optimization_results.yaml").exists()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_study_with_jobs_per_gpu_runs_that_many_trials_at_once_on_one_gpu(slurm_cluster_2n, tmp_path):
    sweep = tmp_path / "study"
    args = ["--config-dir", str(REPO / "tests" / "conf"), "task=tune_probe", "objective=score",
            "hydra/sweeper=expgpu_optuna", "hydra.sweeper.sampler.seed=0", "task.x=interval(0,1)",
            "hydra.sweeper.n_trials=4", "task.max_steps=60", "task.step_s=0.05", "task.slow_step_s=0.05",
            "hydra/launcher=slurm_pool", "hydra.launcher.nodes=1",
            "hydra.launcher.gpus_per_node=1", "hydra.launcher.cpus_per_node=2", "hydra.launcher.pool.jobs_per_gpu=2",
            "logger=none"]
    env = {**slurm_cluster_2n.env, "PYTHONPATH": pythonpath(HELPERS)}
    done = _run(slurm_cluster_2n, args, sweep, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    pool = json.loads((sweep / "pool.json").read_text())
    assert "4 trials, 2 at once" in done.stdout + done.stderr   # the sweeper asks the pool for its GPU's 2 shares
    assert pool["jobs_per_gpu"] == 2 and [j["state"] for j in pool["jobs"]] == ["finished"] * 4
    assert {j["shares"][0] for j in pool["jobs"]} == {0, 1}
    spans = [(j["started"], j["ended"]) for j in pool["jobs"]]
    assert max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans) == 2, "two trials at once on its one GPU"


def test_its_dry_run_prints_the_allocations_script_and_where_the_first_jobs_go(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", *SWEEP, "gpu_map.gpus_per_rank=1,2",
                           "launch.nodes=1,2", "dry_run=true", f"hydra.sweep.dir={sweep}"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --gres=gpu:4", "#SBATCH --time=10", "#SBATCH --exclusive",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR2@120",
                 "-m expgpu -m hydra/launcher=gpu_pool task=a task.max_steps=20 logger=none gpu_map.gpus_per_rank=1,2 "
                 "launch.nodes=1,2 dry_run=true hydra.launcher.grace_s=15.0 hydra.launcher.warm_starts=true "
                 "hydra.launcher.jobs_per_gpu=1 "
                 "hydra.launcher.max_requeues=3 "
                 "hydra.sweep.dir=" + str(sweep)):
        assert line in out, out
    assert "the first 4 job(s) on 2 node(s) x 4 GPU(s) (SLURM names the nodes; whole nodes bring all their GPUs" in out
    first = "task=a task.max_steps=20 logger=none gpu_map.gpus_per_rank=1 launch.nodes"
    assert f"#0 {first}=1 dry_run=True -> node1: GPU 0\n" in out
    assert f"#1 {first}=2 dry_run=True -> node1: GPU 1; node2: GPU 0\n" in out
    assert not (sweep / ".slurm_pool" / "job.json").exists()


def test_without_gpus_its_dry_run_asks_for_none_and_places_the_jobs_on_cpu_slots(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", *SWEEP, "hydra.launcher.gpus_per_node=0",
                           "hydra.launcher.pool.cpu_slots=3", "task.seed=range(4)", "launch.nodes=1",
                           "dry_run=true", f"hydra.sweep.dir={sweep}"], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "#SBATCH --nodes=2" in out and "--gres" not in out and "hydra.launcher.cpu_slots=3" in out, out
    assert "the first 4 job(s) on 2 node(s) x 3 CPU slot(s) (SLURM names the nodes):" in out, out
    assert "task.seed=0 launch.nodes=1 dry_run=True -> node1: CPU slot 0\n" in out, out
    assert "task.seed=3 launch.nodes=1 dry_run=True -> node2: CPU slot 0\n" in out, out


def test_with_jobs_per_gpu_its_dry_run_places_the_first_jobs_on_every_gpu_then_on_second_shares(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", *SWEEP, "hydra.launcher.gpus_per_node=1",
                           "hydra.launcher.pool.jobs_per_gpu=2", "task.seed=range(5)", "dry_run=true",
                           f"hydra.sweep.dir={sweep}"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "hydra.launcher.jobs_per_gpu=2" in out and "#SBATCH --gres=gpu:1" in out, out
    assert "the first 5 job(s) on 2 node(s) x 1 GPU(s), 2 jobs on each" in out, out
    assert [ln.split(" -> ")[1] for ln in out.splitlines() if " -> " in ln] == [
        "node1: GPU 0 (share 1 of 2)", "node2: GPU 0 (share 1 of 2)", "node1: GPU 0 (share 2 of 2)",
        "node2: GPU 0 (share 2 of 2)", "waits for GPUs to free"], out


@pytest.mark.parametrize("args, message", [
    (["hydra.launcher.gpus_per_node=-1"], "hydra.launcher.gpus_per_node=-1 is not allowed: an integer >= 0 (the "
                                          "allocation's GPUs on each node; 0: none, the jobs take CPU slots)"),
    (["hydra.launcher.gpus_per_node=0", "hydra.launcher.pool.cpu_slots=0"],
     "hydra.launcher.pool.cpu_slots=0 is not allowed: an integer >= 1"),
    (["hydra.launcher.gpus_per_node=0", "hydra.launcher.pool.gpus_per_job=1"],
     "hydra.launcher.pool.gpus_per_job=1 is not allowed with hydra.launcher.gpus_per_node=0"),
    (["hydra.launcher.pool.gpus=[0]"], "hydra.launcher.pool.gpus: unknown key; allowed under hydra.launcher.pool: "
                                       "gpus_per_job, max_parallel, nodes, grace_s"),
    (["+hydra.launcher.pool.gpus=[0]"], "hydra.launcher.pool.gpus: unknown key; allowed under hydra.launcher.pool: "
                                        "gpus_per_job, max_parallel"),   # added with +: read by nothing
    (["hydra.launcher.pool.max_parallel=0"], "hydra.launcher.pool.max_parallel=0 is not allowed: an integer >= 1"),
    (["hydra.launcher.pool.jobs_per_gpu=0"], "hydra.launcher.pool.jobs_per_gpu=0 is not allowed: an integer >= 1"),
    (["hydra.launcher.pool.jobs_per_gpu=2", "hydra.launcher.pool.warm_starts=false"],
     "hydra.launcher.pool.jobs_per_gpu=2 is not allowed with hydra.launcher.pool.warm_starts=false inside a SLURM "
     "allocation"),
    (["hydra.launcher.pool.jobs_per_gpu=2", "hydra.launcher.gpus_per_node=0"],
     "hydra.launcher.pool.jobs_per_gpu=2 shares GPUs, and hydra.launcher.gpus_per_node=0 asks for none (its jobs "
     "take CPU slots): drop it, or give more jobs at once with hydra.launcher.pool.cpu_slots"),
    (["hydra.launcher.pool.timeout_min=-1"], "hydra.launcher.pool.timeout_min=-1.0 is not allowed: minutes > 0"),
    (["hydra.launcher.max_requeues=-1"], "hydra.launcher.max_requeues=-1 is not allowed: an integer >= 0 (how often "
                                         "the allocation may requeue itself before its time limit)"),
    (["hydra.launcher.signal_delay_s=0"], "hydra.launcher.signal_delay_s=0 is not allowed: an integer >= 1"),
    (["hydra.launcher.mem_gb=-1"], "hydra.launcher.mem_gb=-1 is not allowed: an integer >= 1 or null (SLURM's "
                                   "default) (hydra/launcher=slurm_pool)"),
    ([], "hydra/launcher=slurm_pool needs SLURM's sbatch"),
    (["gpu_map.gpus_per_rank=1,6"], "job #1 (task=a task.max_steps=20 logger=none gpu_map.gpus_per_rank=6) needs 6 "
                                    "GPUs on each of 1 node(s), but the allocation has at most 4 GPU(s) per node"),
    (["launch.nodes=3"], "asks for launch.nodes=3, but the allocation has 2 node(s); allowed: 1..2"),
    # what each job's start would refuse after the queue (expgpu.task.precheck; a script's keys, spec.checked)
    (["task.lrr=0.1"], "task.lrr: expgpu.tasks.supervised.train takes no parameter 'lrr'; it takes model"),
    (["--config-dir", str(REPO / "tests" / "conf"), "task=script_alone", "~task.max_steps", "task.script=nope.py"],
     "task.script=nope.py: " + str(REPO / "nope.py") + " does not exist"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_is_submitted(tmp_path, args, message):
    env = clean_env(PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                         if not (Path(p) / "sbatch").exists()) or "/nonexistent")
    first = args[:2] if args[:1] == ["--config-dir"] else []   # before the overrides, as argparse wants it
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", *first, *SWEEP, *args[len(first):],
                           f"hydra.sweep.dir={tmp_path / 's'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("expgpu")]
    assert len(said) == 1 and message in said[0] and "Traceback" not in done.stderr, done.stderr
