"""SLURM end to end on the real local cluster (scripts/slurm-local): plain sbatch, the Hydra launcher,
its dry run, and the bad inputs that must fail in one line before anything is submitted."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import pytest
from slurm_cluster import slurm_cluster, slurm_cluster_2n  # noqa: F401

from conftest import HELPERS, PACED, REPO, TESTS, clean_env, multirun

pytestmark = pytest.mark.slurm

# Four simulated GPUs: SLURM hands a job 2 of its 4 fake GPUs (CUDA_VISIBLE_DEVICES=0,1, or 2,3 while
# another job holds 0,1), expgpu narrows the simulated inventory to them, so what lands on which rank
# is visible on a CPU-only machine. Either pair is an A100 and an H100.
SIM = ("inventory.simulate=[{name:A100,memory_mb:81920},{name:H100,memory_mb:81920},"
       "{name:A100,memory_mb:81920},{name:H100,memory_mb:81920}]")


def jobs_named(cluster, name: str, wait_for: int = 0) -> list[str]:
    """Ids of the jobs SLURM saw under this name: in the queue now, or in accounting (which lags a few
    seconds behind, so wait up to 30 s for `wait_for` of them)."""
    deadline = time.monotonic() + 30
    while True:
        queued = cluster.run(["squeue", "-h", "-o", "%i", "--name", name]).stdout.split()
        out = cluster.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "--name", name, "-S", "now-1hour"]).stdout
        found = sorted(set(queued) | set(out.split()))
        if len(found) >= wait_for or time.monotonic() > deadline:
            return found


def error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("expgpu: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.timeout(240)
def test_sbatch_script_trains_two_ranks_over_gloo(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(["--cpus-per-task=1", str(REPO / "scripts" / "expgpu.sbatch"),
                                "task=a", "task.max_steps=30", "gpu_map=ranked", SIM], cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=200) == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()
    result = json.loads((tmp_path / "outputs" / "slurm" / job / "result.json").read_text())
    assert (result["source"], result["world_size"], result["backend"], result["status"]) == \
        ("slurm", 2, "gloo", "finished")
    assert result["steps"] == 30 and len(set(result["rank_checksums"])) == 1   # DDP kept the ranks in step
    # ranked gives the better of the job's two GPUs (A100, H100) to rank 0
    plan = [(r["rank"], r["gpus"][0], r["names"]) for r in result["plan"]]
    assert [(rank, names) for rank, _, names in plan] == [(0, ["H100"]), (1, ["A100"])]
    log = (tmp_path / f"slurm-{job}.out").read_text()   # every rank logs its GPU
    assert "rank 0/2 on" in log and f"(GPU {plan[0][1]}: H100)" in log
    assert "rank 1/2 on" in log and f"(GPU {plan[1][1]}: A100)" in log


@pytest.mark.timeout(240)
def test_launcher_multirun_returns_one_result_per_job(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    proc = multirun(["hydra/launcher=slurm", "task=a", "task.max_steps=30", "gpu_map=sequential,ranked", SIM,
                     "hydra.launcher.gpus_per_node=2", "hydra.launcher.cpus_per_task=1",
                     "hydra.launcher.timeout_min=5"],
                    sweep, slurm_cluster.env, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((sweep / str(n) / "result.json").read_text()) for n in (0, 1)]
    for r in results:   # tasks_per_node followed gpus_per_node: one rank per GPU
        assert (r["source"], r["world_size"], r["status"], r["steps"]) == ("slurm", 2, "finished", 30)
        assert len(set(r["rank_checksums"])) == 1
    assert [p["names"] for p in results[0]["plan"]] == [["A100"], ["H100"]]    # sequential
    assert [p["names"] for p in results[1]["plan"]] == [["H100"], ["A100"]]    # ranked
    assert "-> slurm job" in proc.stderr + proc.stdout


@pytest.mark.timeout(120)
def test_dry_run_prints_the_sbatch_script_and_plan_and_submits_nothing(slurm_cluster, tmp_path):
    name = f"dry-{uuid.uuid4().hex[:8]}"
    proc = multirun(["hydra/launcher=slurm", "task=a,b", "gpu_map=ranked", SIM, "dry_run=true",
                     "hydra.launcher.tasks_per_node=2", f"hydra.launcher.name={name}",
                     "+hydra.launcher.additional_parameters.reservation=none"],
                    tmp_path / "sweep", slurm_cluster.env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in ("#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2", "#SBATCH --array=0-1",
                 f"#SBATCH --job-name={name}", "#SBATCH --reservation=none", "srun --unbuffered"):
        assert line in out, out
    assert "partition debug" in out and "dry run: nothing submitted" in out
    assert out.count("rank  host") == 2 and "H100" in out    # one plan per job
    # and what each of its 2 ranks will hold (expgpu.gpus.memory_estimate): task a's MLP under Adam
    assert "memory per rank for parameters + optimizer state, 2 rank(s): ddp 249.0 KiB (83.0 KiB + 166.0 KiB), " \
           "fsdp 124.5 KiB (41.5 KiB + 83.0 KiB); MLP: 21,252 parameters, Adam" in out, out
    assert out.count("memory per rank") == 2
    assert not (tmp_path / "sweep" / ".submitit").exists()
    assert jobs_named(slurm_cluster, name) == []


@pytest.mark.timeout(120)
def test_bad_cluster_settings_fail_in_one_line_and_submit_nothing(slurm_cluster, tmp_path):
    name = f"bad-{uuid.uuid4().hex[:8]}"
    base = ["hydra/launcher=slurm", "task=a", f"hydra.launcher.name={name}"]

    line = error_line(multirun(base + ["hydra.launcher.partition=nope"], tmp_path / "s1", slurm_cluster.env))
    assert "hydra.launcher.partition='nope'" in line and "allowed: debug" in line

    # a controller that does not answer: the same cluster's config, pointing at a closed port
    conf = tmp_path / "slurm.conf"
    conf.write_text("".join("SlurmctldPort=7999\n" if ln.startswith("SlurmctldPort=") else ln
                            for ln in Path(slurm_cluster.conf).read_text().splitlines(keepends=True)))
    line = error_line(multirun(base, tmp_path / "s2", {**slurm_cluster.env, "SLURM_CONF": str(conf)}))
    assert "controller is unreachable" in line and str(conf) in line

    # the second job of the sweep needs 2 GPUs per rank: checked before the first is submitted
    line = error_line(multirun(base + ["gpu_map.gpus_per_rank=1,2", "hydra.launcher.tasks_per_node=2",
                                       "hydra.launcher.gpus_per_node=2"], tmp_path / "s3", slurm_cluster.env))
    assert "gpu_map.gpus_per_rank=2 need 4 GPU(s) per node" in line and "gpus_per_node=2" in line

    for sweep in ("s1", "s2", "s3"):
        assert not (tmp_path / sweep / ".submitit").exists()
    assert jobs_named(slurm_cluster, name) == []


@pytest.mark.timeout(120)
def test_refused_submission_cancels_the_jobs_already_submitted(slurm_cluster, tmp_path):
    # Two resource shapes -> two arrays; the node has 4 GPUs, so sbatch refuses the second (5 GPUs).
    name = f"half-{uuid.uuid4().hex[:8]}"
    proc = multirun(["hydra/launcher=slurm", "task=a", "task.max_steps=100000", "gpu_map.gpus_per_rank=1,5",
                     f"hydra.launcher.name={name}"], tmp_path / "sweep", slurm_cluster.env)
    line = error_line(proc)
    assert "sbatch refused the job" in line and "cancelled the 1 job(s) already submitted" in line
    # accounting records the refused submission too, as a FAILED job that never ran
    states = {job: slurm_cluster.wait_job(job, timeout=60) for job in jobs_named(slurm_cluster, name, wait_for=2)}
    assert sorted(states.values()) == ["CANCELLED", "FAILED"], states
    assert not (tmp_path / "sweep" / "0" / "result.json").exists()


def test_tasks_per_node_must_fit_the_gpus_without_a_cluster(tmp_path):
    # checked from the config alone: no SLURM needed on this machine
    env = clean_env(PATH=f"{Path(sys.executable).parent}")
    line = error_line(multirun(["hydra/launcher=slurm", "task=a", "hydra.launcher.tasks_per_node=3",
                                "hydra.launcher.gpus_per_node=2"], tmp_path / "sweep", env))
    assert "hydra.launcher.tasks_per_node=3" in line and "need 3 GPU(s) per node" in line
    # gpu_map.gpus narrows any strategy to the GPUs it lists: too few for the ranks is refused before submitting
    line = error_line(multirun(["hydra/launcher=slurm", "task=a", "gpu_map=ranked", "gpu_map.gpus=[0]",
                                "hydra.launcher.gpus_per_node=2"], tmp_path / "sweep1", env))
    assert "gpu_map.gpus=[0] lists 1 GPU(s), but 2 rank(s) per node x gpu_map.gpus_per_rank=1 need 2" in line
    line = error_line(multirun(["hydra/launcher=slurm", "task=a"], tmp_path / "sweep2", env))
    assert "sbatch" in line and "not found on PATH" in line


@pytest.mark.parametrize("launcher", ["slurm", "submitit_local"])
def test_a_task_key_its_function_does_not_take_is_one_line_before_anything_is_submitted(tmp_path, launcher):
    # each job would check it at its start, after its wait in the queue, and every one would fail
    env = clean_env(PATH=f"{Path(sys.executable).parent}", PYTHONPATH=str(HELPERS))
    line = error_line(multirun([f"hydra/launcher={launcher}", "task=a", "task.lrr=0.1,0.2"], tmp_path / "s1", env))
    assert line.startswith("expgpu: error: task.lrr: expgpu.tasks.supervised.train takes no parameter 'lrr'"), line
    assert line.endswith("; job #0 (task=a task.lrr=0.1); nothing was submitted"), line
    # a task function's module is imported (in a child process) and its signature read
    line = error_line(multirun(["--config-dir", str(TESTS / "conf"), f"hydra/launcher={launcher}", "task=probe_paced",
                                "task.step_s=0.1,fast"], tmp_path / "s2", env))
    assert line.startswith("expgpu: error: task.step_s='fast' is not allowed: a number"), line
    assert line.endswith("; job #1 (task=probe_paced task.step_s=fast); nothing was submitted"), line
    for sweep in ("s1", "s2"):
        assert not (tmp_path / sweep / ".submitit").exists()


@pytest.mark.parametrize("launcher, key, value, allowed", [
    ("slurm", "mem_gb", -5, "an integer >= 1 or null (not asked)"),
    ("slurm", "cpus_per_task", 0, "an integer >= 1 or null (not asked)"),
    ("slurm", "signal_delay_s", -5, "an integer >= 0"),
    ("slurm", "max_num_timeout", -1, "an integer >= 0"),
    ("submitit_local", "timeout_min", -1, "an integer >= 0"),
])
def test_a_bad_count_is_one_line_naming_its_key_before_the_cluster_is_asked(tmp_path, launcher, key, value, allowed):
    # sbatch would refuse it naming its own flag (`Invalid --mem specification`): here no SLURM is even needed
    env = clean_env(PATH=f"{Path(sys.executable).parent}")
    line = error_line(multirun([f"hydra/launcher={launcher}", "task=a", f"hydra.launcher.{key}={value}"],
                               tmp_path / "sweep", env))
    assert line == f"expgpu: error: hydra.launcher.{key}={value} is not allowed: {allowed} (hydra/launcher={launcher})"


@pytest.mark.timeout(180)
def test_submitit_local_keeps_the_gpus_this_process_sees(tmp_path):
    # hydra#2602: with gpus_per_node unset, submitit's local executor sets CUDA_VISIBLE_DEVICES="" and
    # hides every GPU. expgpu's preset hands the job the GPUs its parent sees (here 2 and 3 of 4).
    sweep = tmp_path / "sweep"
    proc = multirun(["hydra/launcher=submitit_local", "task=a,b", "task.max_steps=20", SIM], sweep,
                    clean_env(CUDA_VISIBLE_DEVICES="2,3"), timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    for n, task in ((0, "a"), (1, "b")):
        r = json.loads((sweep / str(n) / "result.json").read_text())
        assert (r["task"], r["status"], r["world_size"]) == (task, "finished", 1)
        assert r["plan"][0]["gpus"] == [2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", ["slurm_cluster", "slurm_cluster_2n"], ids=["sacct", "no-accounting"])
def test_cancelled_job_fails_the_sweep_instead_of_hanging(which, request, tmp_path):
    # Without accounting submitit never learns that a job was cancelled and waits forever
    # (scripts/slurm-local/README.md, pitfall 8); expgpu notices the job left the queue.
    cluster = request.getfixturevalue(which)
    name = f"lost-{uuid.uuid4().hex[:8]}"
    proc, jobs = cluster.sweep_cancelled([sys.executable, "-m", "expgpu", "-m", "hydra/launcher=slurm", "task=a",
                                          "task.max_steps=10000000", PACED, "hydra.launcher.gpus_per_node=0",
                                          "hydra.launcher.lost_after_s=3", f"hydra.launcher.name={name}",
                                          f"hydra.sweep.dir={tmp_path / 'sweep'}"], REPO, name)
    err = proc.stderr
    assert proc.returncode == 1 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("expgpu: ") and f"job {jobs[0]}" in line and "without a result" in line, err


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_submitit_local_job_trains_on_a_real_gpu(tmp_path):
    # the job gets this machine's GPUs (not CUDA_VISIBLE_DEVICES="", hydra#2602) and trains on one
    sweep = tmp_path / "sweep"
    proc = multirun(["hydra/launcher=submitit_local", "task=a", "task.max_steps=20"], sweep, clean_env(), timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((sweep / "0" / "result.json").read_text())
    assert r["status"] == "finished" and r["plan"][0]["device"].startswith("cuda")
