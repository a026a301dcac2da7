"""A 2-node job requeued onto 1 node continues, on the real local 2-node SLURM cluster (two slurmd
on this machine, scripts/slurm-local with SLURM_LOCAL_NODES=2).

scripts/expgpu.sbatch starts ntasks-per-node ranks on every node the job got this time. The job
is submitted on 2 nodes x 2 tasks (4 ranks), trains, and is requeued (`scontrol requeuehold`:
SIGTERM, expgpu saves and stops, the job goes back to PENDING, held). While it waits, its
allocation is changed to 1 node (`scontrol update NumNodes=1-1 NumTasks=2`), as a scheduler hands a requeued
job whatever fits now; released, it starts 2 ranks and resumes the 4-rank checkpoint on them
(expgpu.checkpoint.world_change): the same global batch, the next global sample.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from slurm_cluster import slurm_cluster_2n  # noqa: F401

from conftest import PACED, REPO, wait_until

pytestmark = pytest.mark.slurm

# Paced (conftest.PACED; 12.8 ms a step on 2 ranks after the requeue, each with 128 examples):
# seconds of training, so the requeue lands mid-way, at little CPU.
STEPS = 600
ARGS = ["task=a", f"task.max_steps={STEPS}", "task.log_every=5", "backend.timeout_s=60", PACED]
STOPPED = re.compile(r"expgpu: stopped at step (\d+) of \d+ by (\w+); checkpoint saved\.")


def _fields(cluster, job: str) -> dict:
    out = cluster.run(["scontrol", "-o", "show", "job", job], check=False).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def _rows(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


@pytest.mark.timeout(300)
def test_two_node_job_requeued_onto_one_node_resumes_on_two_ranks(slurm_cluster_2n, tmp_path):
    cluster = slurm_cluster_2n
    job = cluster.sbatch(["-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
                          str(REPO / "scripts" / "expgpu.sbatch"), *ARGS], cwd=tmp_path)
    out = tmp_path / f"slurm-{job}.out"
    run_dir = tmp_path / "outputs" / "slurm" / job
    wait_until("training progress on 2 nodes",
              lambda: len(_rows(run_dir)) >= 2 or cluster.state(job) in ("FAILED", "COMPLETED"), timeout=150)
    assert cluster.state(job) == "RUNNING", out.read_text()[-4000:]
    assert _fields(cluster, job)["NumNodes"] == "2"
    cluster.run(["scontrol", "requeuehold", job])
    wait_until("the stop line and the held requeue",
              lambda: STOPPED.findall(out.read_text()) and cluster.state(job) == "PENDING", timeout=90)
    (stopped_at, sig), = STOPPED.findall(out.read_text())
    assert sig == "SIGTERM"
    # min-max 1-1 (NumNodes=1 alone sets only the minimum: it would get both nodes again), 2 tasks
    cluster.run(["scontrol", "update", f"jobid={job}", "NumNodes=1-1", "NumTasks=2"])
    cluster.run(["scontrol", "release", job])
    assert cluster.wait_job(job, timeout=240) == "COMPLETED", out.read_text()[-4000:]
    log = out.read_text()
    assert "(restart 1) on" in log and "1 node(s)" in log, log[-4000:]
    assert _fields(cluster, job)["NumNodes"] == "1"
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["source"], result["world_size"]) == ("finished", "slurm", 2), result
    assert result["resumed_from_step"] == int(stopped_at) and result["steps"] == STEPS
    assert len(set(result["rank_checksums"])) == 1
    assert "resuming 2 rank(s) from a checkpoint of 4" in log
    # task.batch_size 64 per rank at the start on 4 ranks: 128 per rank on 2, the same 256 a step
    assert "task.batch_size 128 (its share of 64 x 4 at the start) x 2 rank(s) = 256" in result["step_means"]
    steps = [r["step"] for r in _rows(run_dir)]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS, "metrics.jsonl repeats or skips steps"
    assert _rows(run_dir)[-1]["loss"] < _rows(run_dir)[0]["loss"]
