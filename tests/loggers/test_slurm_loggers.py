"""Loggers under hydra/launcher=slurm on the real local SLURM cluster (scripts/slurm-local).

The loggers' sweep of tests/loggers/test_loggers.py, submitted as a SLURM job array through expgpu's
launcher: every srun task of a job runs Hydra's job function, and still each job is one MLflow run
in the sweep's store and one TensorBoard run, written by rank 0 alone. Then a job preempted the way
submitit does it (SIGTERM, SIGUSR2), requeued by submitit and resumed from its checkpoint, continues
the same MLflow run and TensorBoard run, with every step once; so does a plain sbatch job (a single
run) requeued by `scontrol requeue`.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import restarts, slurm_cluster  # noqa: F401
from test_loggers import (
    SWEEP,
    SWEEP_JOBS,
    _history,
    _mlflow,
    _mlflow_history,
    _same_floats,
    _tensorboard,
    assert_one_logger_run_per_job,
)

from conftest import PACED, REPO, wait_until

pytestmark = pytest.mark.slurm

# CPU ranks: the test cluster's 8 declared CPUs are shared by every test running beside this one.
LAUNCHER = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1"]


@pytest.mark.timeout(300)
def test_a_slurm_sweep_is_one_mlflow_and_tensorboard_run_per_job_from_rank_0(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    # Two srun tasks per job: both run the Hydra job function; only rank 0 may make logger runs.
    proc = subprocess.run([sys.executable, "-m", "expgpu", "-m", *SWEEP, "logger=[csv,tensorboard,mlflow]", *LAUNCHER,
                           "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5",
                           f"hydra.sweep.dir={sweep}"],
                          cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "-> slurm job" in proc.stdout + proc.stderr   # submitted, not run here
    for num in SWEEP_JOBS.values():
        result = json.loads((sweep / num / "result.json").read_text())
        assert (result["source"], result["world_size"], result["status"]) == ("slurm", 2, "finished")
        with open(sweep / num / "metrics.csv", newline="") as f:
            assert [int(r["step"]) for r in csv.DictReader(f)] == [s for s, _ in _history(sweep / num, "loss")]
    assert_one_logger_run_per_job(sweep, SWEEP_JOBS)


# Seconds of training, so the preemption lands mid-way: after the 40 rows (step 200) the tests wait
# for, a stop lands within 1 s (about 130 steps of 7-8 ms: paced, conftest.PACED).
STEPS = 1000
ARGS = ["task=a", f"task.max_steps={STEPS}", "task.log_every=5", "logger=[tensorboard,mlflow]", PACED]


@pytest.mark.timeout(300)
def test_a_slurm_job_preempted_and_requeued_continues_the_same_logger_runs(slurm_cluster, tmp_path, monkeypatch):
    from submitit.slurm.slurm import SlurmJob

    sweep, run_dir = tmp_path / "sweep", tmp_path / "sweep" / "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "expgpu", "-m", *ARGS, *LAUNCHER,
         # submitit counts a SIGUSR2 within 10 min of a limit under 15 min as a timeout
         "hydra.launcher.timeout_min=20", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=slurm_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Some rows in the loggers before the preemption
        wait_until("training progress", lambda: _rows(run_dir) >= 40 or proc.poll() is not None, timeout=150)
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        first = json.loads((run_dir / ".expgpu" / "loggers.json").read_text())
        [folder] = [p for p in (sweep / ".submitit").iterdir() if p.is_dir()]   # .submitit/<job id>
        monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)   # for the scancel it runs here
        SlurmJob(folder=folder, job_id=folder.name)._interrupt()   # preemption: SIGTERM, then SIGUSR2
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (out + err)[-4000:]
    assert restarts(slurm_cluster, folder.name) == 1
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and 0 < result["resumed_from_step"] < STEPS, result

    loss = _history(run_dir, "loss")
    assert [s for s, _ in loss] == list(range(5, STEPS + 1, 5))   # metrics.jsonl: every step once
    saved = json.loads((run_dir / ".expgpu" / "loggers.json").read_text())
    assert saved["mlflow"] == first["mlflow"] and saved["tensorboard"] == first["tensorboard"]
    store = _mlflow(sweep)
    [experiment] = [e for e in store.search_experiments() if e.name != "Default"]
    [run] = store.search_runs([experiment.experiment_id])   # one MLflow run, not one per start
    assert run.info.run_id == first["mlflow"]["run_id"] and run.info.status == "FINISHED"
    _same_floats(_mlflow_history(sweep, run.info.run_id, "loss"), loss)
    assert run.data.metrics["final_loss"] == result["metrics"]["final_loss"]
    _same_floats(_tensorboard(Path(first["tensorboard"]["dir"]), "loss"), loss)


@pytest.mark.timeout(300)
def test_an_sbatch_job_requeued_by_scontrol_continues_the_same_logger_runs(slurm_cluster, tmp_path):
    # Plain sbatch, a single run in outputs/slurm/<job id> (its own MLflow store): SLURM's SIGTERM,
    # expgpu's stop checkpoint, SLURM's restart of the batch script in the same run dir.
    job = slurm_cluster.sbatch(["--cpus-per-task=1", "--gpus-per-node=0", "--ntasks-per-node=1",
                                str(REPO / "scripts" / "expgpu.sbatch"), *ARGS], cwd=tmp_path)
    out, run_dir = tmp_path / f"slurm-{job}.out", tmp_path / "outputs" / "slurm" / job
    wait_until("training progress", lambda: _rows(run_dir) >= 40 or slurm_cluster.state(job) in ("FAILED", "COMPLETED"),
              timeout=150)
    assert slurm_cluster.state(job) == "RUNNING", out.read_text()[-4000:]
    first = json.loads((run_dir / ".expgpu" / "loggers.json").read_text())
    slurm_cluster.run(["scontrol", "requeue", job])
    assert slurm_cluster.wait_job(job, timeout=200) == "COMPLETED", out.read_text()[-4000:]
    assert restarts(slurm_cluster, job) == 1
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and 0 < result["resumed_from_step"] < STEPS, result

    loss = _history(run_dir, "loss")
    assert [s for s, _ in loss] == list(range(5, STEPS + 1, 5))
    assert json.loads((run_dir / ".expgpu" / "loggers.json").read_text())["mlflow"] == first["mlflow"]
    store = _mlflow(run_dir)
    [run] = [r for e in store.search_experiments() for r in store.search_runs([e.experiment_id])]
    assert run.info.run_id == first["mlflow"]["run_id"] and run.info.status == "FINISHED"
    _same_floats(_mlflow_history(run_dir, run.info.run_id, "loss"), loss)
    _same_floats(_tensorboard(run_dir / "tensorboard", "loss"), loss)


def _rows(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0
