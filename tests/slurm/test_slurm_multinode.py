"""Multi-node on a real 2-node SLURM allocation: two slurmd on this machine (SLURM's multiple-slurmd
mode, scripts/slurm-local with SLURM_LOCAL_NODES=2), nodes `hostname -s` and localhost. Every rank
finds its node, the node count and MASTER_ADDR (the first host of the node list) from SLURM alone."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from slurm_cluster import slurm_cluster_2n  # noqa: F401

from conftest import REPO

pytestmark = pytest.mark.slurm


def job_fields(cluster, job: str) -> dict:
    out = cluster.run(["scontrol", "-o", "show", "job", job]).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


@pytest.mark.timeout(240)
def test_sbatch_on_two_nodes_trains_four_ranks(slurm_cluster_2n, tmp_path):
    cluster = slurm_cluster_2n
    job = cluster.sbatch(["-N", "2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                          str(REPO / "scripts" / "expgpu.sbatch"), "task=a", "task.max_steps=30"], cwd=tmp_path)
    assert cluster.wait_job(job, timeout=200) == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()
    fields = job_fields(cluster, job)
    assert fields["NumNodes"] == "2" and sorted(fields["NodeList"].split(",")) == sorted(cluster.nodes)
    result = json.loads((tmp_path / "outputs" / "slurm" / job / "result.json").read_text())
    assert (result["source"], result["world_size"], result["status"]) == ("slurm", 4, "finished")
    assert len(set(result["rank_checksums"])) == 1    # one process group across both nodes
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert all(f"rank {r}/4 on" in log for r in range(4))


@pytest.mark.timeout(240)
def test_launcher_two_nodes_one_task_each_spawning_two_ranks(slurm_cluster_2n, tmp_path):
    # One srun task per node runs expgpu's own spawn of 2 workers: node rank and rendezvous still
    # come from SLURM (the task's rank is the node's rank, MASTER_ADDR the first node).
    cluster = slurm_cluster_2n
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "expgpu", "-m", "hydra/launcher=slurm", "task=b",
                           "task.max_steps=30", "launch.nproc_per_node=2", "hydra.launcher.nodes=2",
                           "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
                           f"hydra.sweep.dir={sweep}"],
                          cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert (result["world_size"], result["status"], result["steps"]) == (4, "finished", 30)
    assert len(set(result["rank_checksums"])) == 1
    job = re.search(r"-> slurm job (\d+)", proc.stdout + proc.stderr).group(1)
    fields = job_fields(cluster, job)
    assert fields["NumNodes"] == "2"
