"""A run dir whose run is in progress on another node (expgpu.status.busy): its process record names a host
where this process cannot look up the pid, and a SLURM job, which SLURM's queue can vouch for from any node. A
second run is refused while that job is in the queue (running, or requeued to run there again), not once it
has left it, and never when it is this process's own job (a requeued job resuming its own run)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from slurm_cluster import slurm_cluster_2n  # noqa: F401

from conftest import wait_until
from expgpu.errors import RunDirBusy
from expgpu.status.busy import refuse_busy

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def _record(run_dir: Path, job: str) -> None:
    (run_dir / ".expgpu").mkdir(parents=True, exist_ok=True)
    (run_dir / ".expgpu" / "process.json").write_text(json.dumps(
        {"pid": 4242, "host": socket.gethostname() + "-node7", "created": 1.0, "started": 1.0, "job": job}))


def test_a_run_on_another_node_refuses_while_its_slurm_job_is_queued(slurm_cluster_2n, tmp_path, monkeypatch):
    for key, value in slurm_cluster_2n.env.items():   # squeue reaches the cluster
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    job = slurm_cluster_2n.run(["sbatch", "--parsable", "--begin=now+600", "--wrap", "sleep 1"]).stdout.strip()
    _record(tmp_path, job)
    try:
        with pytest.raises(RunDirBusy, match=f"a run is in progress there \\(SLURM job {job}, PENDING, pid 4242 on "):
            refuse_busy(tmp_path)
        monkeypatch.setenv("SLURM_JOB_ID", job)   # its own job, requeued: the same run resuming
        refuse_busy(tmp_path)
        monkeypatch.delenv("SLURM_JOB_ID")
    finally:
        slurm_cluster_2n.run(["scancel", job])
    wait_until(f"job {job} to leave the queue",
               lambda: slurm_cluster_2n.run(["squeue", "-h", "-j", job], check=False).stdout.strip() == "", 60)
    refuse_busy(tmp_path)   # ended: a rerun resumes there
