"""Preemption, time limits and requeue on the real local SLURM cluster (scripts/slurm-local).

A 2-rank job (two srun tasks, gloo, CPU) is interrupted mid-training the ways SLURM does it,
is requeued, starts again in the SAME run dir (outputs/slurm/<job id>), resumes from its
checkpoint and ends with the parameters of an uninterrupted run: computed here by expgpu's
own 2-rank local spawn, the same math as two srun tasks.

- `scontrol requeue J`: SLURM sends SIGTERM and requeues; expgpu only saves.
- `scancel --signal=USR2 J` (what `--signal=USR2@N` sends before a time limit): expgpu saves
  and rank 0 requeues the job itself.
- a real time limit: `--signal=USR2@20` and a one-minute limit set once the job trains, SLURM's own warning.
- the Hydra launcher (submitit): submitit's `job._interrupt()` (SIGTERM, then SIGUSR2);
  expgpu saves, then hands over to submitit, which requeues.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import restarts, slurm_cluster  # noqa: F401

from conftest import PACED, REPO, expgpu, wait_until

pytestmark = pytest.mark.slurm   # conftest runs every slurm test in one xdist group

# Seconds of training for 2 CPU ranks, paced (conftest.PACED), so that a requeue lands mid-way (a
# stop lands within 1 s).
STEPS = 600
ARGS = ["task=a", f"task.max_steps={STEPS}", "task.log_every=5", "backend.timeout_s=60", PACED]
STOPPED = re.compile(r"expgpu: stopped at step (\d+) of \d+ by (\w+); checkpoint saved\. (.*)")
# The test cluster's 8 declared CPUs are shared by every test running beside this one.
SBATCH = ["--cpus-per-task=1", "--gpus-per-node=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """param_checksum of the uninterrupted run, by the local 2-rank spawn."""
    run = expgpu(ARGS + ["launch.nproc_per_node=2"], tmp_path_factory.mktemp("ref") / "run", timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.result["param_checksum"]


def _progress(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and metrics.read_text().count("\n") >= 1


def _assert_resumed_in_place(work: Path, job: str, log: str, checksum: str | None) -> dict:
    """One run dir for the job, a resumed and finished result, the uninterrupted parameters."""
    assert [p.name for p in (work / "outputs").iterdir()] == ["slurm"], "a second run dir was made"
    assert [p.name for p in (work / "outputs" / "slurm").iterdir()] == [job]
    run_dir = work / "outputs" / "slurm" / job
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["source"], result["world_size"]) == ("finished", "slurm", 2), result
    assert result["resumed_from_step"] and 0 < result["resumed_from_step"] < result["steps"], result
    assert len(set(result["rank_checksums"])) == 1
    if checksum is not None:
        assert result["param_checksum"] == checksum
    assert f"resumed from {run_dir / 'checkpoint.pt'} at step {result['resumed_from_step']}" in log
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == result["steps"], "metrics.jsonl repeats steps"
    return result


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["scontrol requeue", "scancel --signal=USR2"])
def test_job_requeued_mid_training_resumes_to_the_uninterrupted_parameters(slurm_cluster, tmp_path,
                                                                           reference, how):
    job = slurm_cluster.sbatch([*SBATCH, str(REPO / "scripts" / "expgpu.sbatch"), *ARGS], cwd=tmp_path)
    out = tmp_path / f"slurm-{job}.out"
    run_dir = tmp_path / "outputs" / "slurm" / job
    wait_until("training progress", lambda: _progress(run_dir) or slurm_cluster.state(job) in ("FAILED", "COMPLETED"),
              timeout=120)
    assert slurm_cluster.state(job) == "RUNNING", out.read_text()
    if how == "scontrol requeue":
        slurm_cluster.run(["scontrol", "requeue", job])
    else:
        slurm_cluster.run(["scancel", "--signal=USR2", job])
    assert slurm_cluster.wait_job(job, timeout=180) == "COMPLETED", out.read_text()[-4000:]
    log = out.read_text()
    assert restarts(slurm_cluster, job) == 1 and "(restart 1)" in log
    stopped = STOPPED.findall(log)
    assert len(stopped) == 1, log[-4000:]
    step, sig, then = stopped[0]
    if how == "scontrol requeue":
        assert sig == "SIGTERM" and then.startswith(f"If SLURM requeues job {job} ")  # not expgpu again
    else:
        assert sig == "SIGUSR2" and then.startswith(f"Requeued SLURM job {job}: ")
    result = _assert_resumed_in_place(tmp_path, job, log, reference)
    assert result["resumed_from_step"] == int(step)


@pytest.mark.timeout(180)
def test_job_that_cannot_be_requeued_says_so_and_how_to_resume(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch([*SBATCH, "--no-requeue", str(REPO / "scripts" / "expgpu.sbatch"), *ARGS],
                               cwd=tmp_path)
    out = tmp_path / f"slurm-{job}.out"
    run_dir = tmp_path / "outputs" / "slurm" / job
    wait_until("training progress", lambda: _progress(run_dir) or slurm_cluster.state(job) in ("FAILED", "COMPLETED"),
              timeout=120)
    slurm_cluster.run(["scancel", "--signal=USR2", job])
    assert slurm_cluster.wait_job(job, timeout=120) == "FAILED", out.read_text()[-4000:]
    errors = [line for line in out.read_text().splitlines() if line.startswith("expgpu: error:")]
    assert len(errors) == 1, out.read_text()[-4000:]
    assert f"cannot requeue SLURM job {job}: `scontrol requeue {job}` failed:" in errors[0]
    assert errors[0].endswith(f"resubmit with hydra.run.dir={run_dir} to resume"), errors[0]
    assert (run_dir / "checkpoint.pt").exists() and "Traceback" not in out.read_text()


JOB_WITH_MOVING_FINISH = """#!/bin/bash
#SBATCH --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0
#SBATCH --requeue --open-mode=append --time=2 --signal=USR2@20
# max_steps is read at every start: the test moves the finish line once the job has been
# requeued (max_steps may change on resume), so the second start ends in seconds.
echo "restart ${SLURM_RESTART_COUNT:-0}"
srun --kill-on-bad-exit=1 python -m expgpu task=a task.max_steps=$(cat max_steps) task.log_every=5 \\
    backend.timeout_s=60 {PACED}
""".replace("{PACED}", PACED)


@pytest.mark.timeout(300)
def test_job_warned_before_its_time_limit_requeues_itself_and_finishes(slurm_cluster, tmp_path):
    # --signal=USR2@20: SLURM checks time limits every 30 s and warns at the first check past
    # end - 20 s - 30 s. With --time=2 that is 70 to 100 s after the start; once the job is
    # training, a limit of one minute brings the warning to the next check (within 30 s), unless
    # that could land past the minute itself. A warning during the start-up would stop the job
    # at step 0 (seen under load), which is not what this test is about. Until the warning the
    # job trains toward a finish line it cannot reach, its steps paced by a sleep.
    (tmp_path / "job.sbatch").write_text(JOB_WITH_MOVING_FINISH)
    (tmp_path / "max_steps").write_text("10000000")
    submitted = time.monotonic()
    job = slurm_cluster.sbatch(["job.sbatch"], cwd=tmp_path)
    out = tmp_path / f"slurm-{job}.out"
    run_dir = tmp_path / "outputs" / "slurm" / job
    wait_until("training progress",
              lambda: _progress(run_dir) or slurm_cluster.state(job) in ("FAILED", "COMPLETED", "TIMEOUT"),
              timeout=100)
    if time.monotonic() - submitted < 25:   # an upper bound on the time since the job started
        slurm_cluster.run(["scontrol", "update", f"jobid={job}", "TimeLimit=1"])
    wait_until("the time-limit warning and the requeue",
              lambda: restarts(slurm_cluster, job) >= 1 or slurm_cluster.state(job) in ("FAILED", "TIMEOUT"),
              timeout=120, every=0.05)
    assert restarts(slurm_cluster, job) == 1, out.read_text()[-4000:]
    # rank 0 prints its line just after its `scontrol requeue` returned
    stopped = wait_until("rank 0's stop line", lambda: STOPPED.findall(out.read_text()), timeout=20)
    assert len(stopped) == 1, out.read_text()[-4000:]
    step, sig, then = stopped[0]
    assert sig == "SIGUSR2" and then.startswith(f"Requeued SLURM job {job}: "), stopped
    # The requeued job waits about 10 s (cred_expire) before it starts again: time to give it a
    # near finish line and a limit it will not meet again.
    (tmp_path / "max_steps").write_text(str(int(step) + 300))
    slurm_cluster.run(["scontrol", "update", f"jobid={job}", "TimeLimit=10"])
    assert slurm_cluster.wait_job(job, timeout=150) == "COMPLETED", out.read_text()[-4000:]
    log = out.read_text()
    assert "restart 1" in log
    result = _assert_resumed_in_place(tmp_path, job, log, checksum=None)
    assert result["resumed_from_step"] == int(step) and result["steps"] == int(step) + 300


@pytest.mark.timeout(240)
def test_hydra_launcher_job_preempted_by_submitit_resumes(slurm_cluster, tmp_path, reference, monkeypatch):
    """submitit owns SIGUSR2 in its jobs: expgpu saves first, then lets submitit requeue."""
    from submitit.slurm.slurm import SlurmJob

    sweep = tmp_path / "sweep"
    client = subprocess.Popen(
        [sys.executable, "-m", "expgpu", "-m", "hydra/launcher=slurm", *ARGS, "hydra.launcher.tasks_per_node=2",
         "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
         # submitit counts a SIGUSR2 within 10 min of a limit under 15 min as a timeout
         "hydra.launcher.timeout_min=20", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=slurm_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = sweep / "0"
        wait_until("training progress", lambda: _progress(run_dir) or client.poll() is not None, timeout=120)
        assert client.poll() is None, client.communicate()[1][-4000:]
        folders = [p for p in (sweep / ".submitit").iterdir() if p.is_dir()]   # .submitit/<job id>
        assert len(folders) == 1, folders
        job = folders[0].name
        monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)  # for the scancel it runs here
        SlurmJob(folder=folders[0], job_id=job)._interrupt()   # preemption: SIGTERM, then SIGUSR2
        out, err = client.communicate(timeout=180)
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()
    assert client.returncode == 0, (out + err)[-4000:]
    log = "".join(p.read_text() for p in sorted(folders[0].glob("*_0_log.*")))
    # Order in rank 0's log: expgpu's checkpoint, then submitit's requeue.
    saved = re.search(r"checkpoint at step (\d+) \(stop requested\)", log)
    assert saved and log.index(saved.group(0)) < log.index(f"Requeued job {job}"), log[-4000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and result["resumed_from_step"] == int(saved.group(1))
    assert result["param_checksum"] == reference
    assert restarts(slurm_cluster, job) == 1


@pytest.mark.timeout(240)
def test_a_script_without_a_sigterm_handler_preempted_by_submitit_is_requeued_and_resumes(slurm_cluster, tmp_path,
                                                                                           monkeypatch):
    """A preemption's SIGTERM reaches the script too (SLURM signals every process of the step) and kills a
    script that has no handler for it; the SIGUSR2 that follows still requeues the job, and the rerun
    starts the script with its resume_args from its own last checkpoint."""
    from submitit.slurm.slurm import SlurmJob

    sweep = tmp_path / "sweep"
    client = subprocess.Popen(
        [sys.executable, "-m", "expgpu", "-m", "--config-dir", str(REPO / "tests" / "conf"), "hydra/launcher=slurm",
         "task=script_probe_resume", "task.args.on-term=default", "task.args.steps=150", "task.args.save-every=5",
         "task.args.log=true", "hydra.launcher.tasks_per_node=1", "hydra.launcher.gpus_per_node=0",
         "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=20", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=slurm_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = sweep / "0"
        wait_until("a checkpoint of the script's", lambda: (run_dir / "ckpt.txt").exists() or client.poll() is not None,
                   timeout=120)
        assert client.poll() is None, client.communicate()[1][-4000:]
        folders = [p for p in (sweep / ".submitit").iterdir() if p.is_dir()]
        assert len(folders) == 1, folders
        job = folders[0].name
        monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)
        SlurmJob(folder=folders[0], job_id=job)._interrupt()   # preemption: SIGTERM, then SIGUSR2
        out, err = client.communicate(timeout=180)
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()
    assert client.returncode == 0, (out + err)[-4000:]
    log = "".join(p.read_text() for p in sorted(folders[0].glob("*_0_log.*")))
    assert f"Requeued job {job}" in log, log[-4000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["resumed"], result["attempt"]) == ("finished", True, 1), result
    assert json.loads((run_dir / "started-rank0.json").read_text())["argv"][-1] == "--resume"
    assert restarts(slurm_cluster, job) == 1
