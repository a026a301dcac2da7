"""SLURM's task layouts on a real 2-node allocation (scripts/slurm-local, two slurmd on this machine):
the dry-run plan of each node names the ranks SLURM really started there, for block (uneven 3,2) and
cyclic steps, and `srun -E` in a larger allocation trains a world of the step's size."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from slurm_cluster import slurm_cluster_2n  # noqa: F401

pytestmark = pytest.mark.slurm

SIM4 = "inventory.simulate=[" + ",".join(["{name:A100,memory_mb:40960}"] * 4) + "]"

# Each task first records where SLURM put it (its SLURM_PROCID on its node), then runs expgpu's dry
# run in a run dir of its own; only each node's local rank 0 writes the plan.
JOB = f"""#!/bin/bash
set -euo pipefail
for layout in block cyclic; do
  srun -n5 -m $layout bash -c 'echo "$SLURM_PROCID $SLURMD_NODENAME" > where-'$layout'-$SLURM_PROCID.txt
    exec python -m expgpu dry_run=true gpu_map=sequential "{SIM4}" hydra.run.dir=runs/'$layout'/$SLURM_PROCID'
done
# --preserve-env: SLURM_NTASKS stays 6 (the allocation's); the step has 2 tasks
srun -E -N1 -n2 bash -c 'echo "$SLURM_NTASKS $SLURM_STEP_NUM_TASKS" > preserved-$SLURM_PROCID.txt
  exec python -m expgpu task=a task.max_steps=5 hydra.run.dir=runs/preserve-env'
"""


def placed_by_slurm(run: object, layout: str) -> dict[str, list[int]]:
    nodes = defaultdict(list)
    for path in run.glob(f"where-{layout}-*.txt"):
        rank, node = path.read_text().split()
        nodes[node].append(int(rank))
    return {node: sorted(ranks) for node, ranks in nodes.items()}


def planned_by_expgpu(run: object, layout: str) -> list[list[int]]:
    plans = sorted((run / "runs" / layout).glob("*/plan.json"))
    return sorted([r["rank"] for r in json.loads(p.read_text())["ranks"]] for p in plans)


@pytest.mark.timeout(300)
def test_block_cyclic_and_srun_e_on_a_real_allocation(slurm_cluster_2n, tmp_path):
    cluster = slurm_cluster_2n
    (tmp_path / "job.sh").write_text(JOB)
    job = cluster.sbatch(["-N2", "--ntasks-per-node=3", "--cpus-per-task=1", "job.sh"], cwd=tmp_path)
    log = tmp_path / f"slurm-{job}.out"
    assert cluster.wait_job(job, timeout=280) == "COMPLETED", log.read_text() if log.exists() else job

    block, cyclic = placed_by_slurm(tmp_path, "block"), placed_by_slurm(tmp_path, "cyclic")
    assert sorted(block.values()) == [[0, 1, 2], [3, 4]]         # uneven: 3 tasks, then 2
    assert sorted(cyclic.values()) == [[0, 2, 4], [1, 3]]        # round robin
    assert planned_by_expgpu(tmp_path, "block") == sorted(block.values())
    assert planned_by_expgpu(tmp_path, "cyclic") == sorted(cyclic.values())

    assert {p.read_text().split()[0] for p in tmp_path.glob("preserved-*.txt")} == {"6"}   # -E kept it
    result = json.loads((tmp_path / "runs" / "preserve-env" / "result.json").read_text())
    assert (result["status"], result["world_size"], result["steps"]) == ("finished", 2, 5)
    assert len(set(result["rank_checksums"])) == 1
