"""The node plan as a process sees it: pinned by its launcher, or shared by local rank 0; and the
ranks the dry-run table and plan.json label it with, for every layout the launchers produce."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import pytest
from launcher_envs import CYCLIC_NODE0, CYCLIC_NODE1, SRUN_E, TORCHRUN_2_PLUS_1_NODE1

from conftest import REPO, clean_env, expgpu
from expgpu import rundir
from expgpu.gpus import placement
from expgpu.ranks import RankInfo

SIM = [{"name": "A100", "memory_mb": 40960, "free_mb": 30000}, {"name": "V100", "memory_mb": 16384},
       {"name": "A100", "memory_mb": 40960, "free_mb": 40000}, {"name": "T4", "memory_mb": 15360}]


def cfg(strategy="sequential", simulate=SIM):
    return {"inventory": {"simulate": simulate},
            "gpu_map": {"strategy": strategy, "gpus": None, "scores": {}, "min_free_mb": 0, "max_util": 100,
                        "gpus_per_rank": 1, "share": False}}


def info(local_rank, lws=2):
    return RankInfo(local_rank, local_rank, lws, lws, 0, "127.0.0.1", 29500, "torchrun")


def test_a_rank_that_sees_one_gpu_uses_it_whatever_its_local_rank(tmp_path):
    # srun --gpus-per-task=1: local rank 1 was given physical GPU 2 by the mask
    node = placement.shared(cfg(), info(1), tmp_path, 5, env={"CUDA_VISIBLE_DEVICES": "2"})
    assert node.strategy == "inherited"
    assert [g.index for g in node.gpus_of(1)] == [2] and node.gpus_of(0) == ()


def test_local_rank_0_plans_once_and_the_others_read_it(tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "0"}
    seen = {}

    def rank(r):
        seen[r] = placement.shared(cfg("free_memory"), info(r), tmp_path, 10, env=env)

    late = threading.Thread(target=rank, args=(1,))
    late.start()          # waits for local rank 0's plan
    rank(0)
    late.join(10)
    assert seen[0] == seen[1]
    assert [[g.index for g in a] for a in seen[0].assignments] == [[2], [0]]
    path = rundir.node_plan_file(tmp_path, socket.gethostname(), "torchrun-r1-0")
    assert json.loads(path.read_text())["strategy"] == "free_memory"


def test_a_restart_does_not_read_the_previous_launch_plan(tmp_path):
    env0 = {"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "0"}
    placement.shared(cfg("sequential"), info(0), tmp_path, 5, env=env0)
    assert placement.launch_id({**env0, "TORCHELASTIC_RESTART_COUNT": "1"}) != placement.launch_id(env0)


def test_dry_run_table_shows_rank_host_gpu_name_memory_score():
    node = placement.compute(cfg("ranked"), 2)
    rows = placement.rows(node, (1, 3), host="n1")   # e.g. node 1 of `srun -N2 -n4 -m cyclic`
    assert [r["rank"] for r in rows] == [1, 3] and rows[0]["host"] == "n1"
    text = placement.table(rows, "ranked")
    assert "A100" in text and "40 GiB" in text and text.splitlines()[1].split()[:4] == ["rank", "host", "local", "gpu"]


# --- the ranks a node's plan is labelled with ------------------------------------------------------

def test_node_ranks_of_a_launchers_processes_and_of_spawned_workers():
    cyclic = RankInfo(1, 0, 4, 2, 1, "n0", 1, "slurm", 2, (1, 3))    # `srun -N2 -n4 -m cyclic`, node 1
    assert placement.node_ranks(cyclic, 2) == (1, 3)
    # One srun task per node (task 1), expgpu's spawn starting 2 workers under it: ranks 2 and 3.
    supervisor = RankInfo(1, 0, 2, 1, 1, "n0", 1, "slurm", 2)
    assert placement.node_ranks(supervisor, 2) == (2, 3)
    assert placement.node_ranks(RankInfo(0, 0, 1, 1, 0, "127.0.0.1", 0, "single"), 4) == (0, 1, 2, 3)


SIM4 = "inventory.simulate=[" + ",".join(["{name:A100,memory_mb:40960}"] * 4) + "]"
# srun(1)'s SLURM_TASKS_PER_NODE example, 2(x3),1, as a task of `srun -n7 -N4 [-m cyclic]` sees it.
UNEVEN = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_NUM_NODES": "4",
          "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_STEP_NODELIST": "gpu-[001-003,010]", "SLURM_LOCALID": "0"}
FIRST_TASK = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}   # local rank 0 prints the node's table
LABELS = {
    "srun -m cyclic, node 0": ({**CYCLIC_NODE0, **FIRST_TASK}, [], [0, 2, 3, 4]),
    "srun -m cyclic, node 1": (CYCLIC_NODE1, [], [1]),
    "srun -E, 2 tasks in a 5-task allocation": ({**SRUN_E, **FIRST_TASK}, [], [0, 1]),
    "2(x3),1 block, node 3": ({**UNEVEN, "SLURM_NODEID": "3", "SLURM_PROCID": "6", "SLURM_GTIDS": "6",
                               "SLURM_DISTRIBUTION": "block"}, [], [6]),
    "2(x3),1 cyclic, node 1": ({**UNEVEN, "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_GTIDS": "1,5",
                                "SLURM_DISTRIBUTION": "cyclic"}, [], [1, 5]),
    "torchrun 2+1 workers, node 1": (TORCHRUN_2_PLUS_1_NODE1, [], [2]),
    "one srun task per node, spawning 2": (
        {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
         "SLURM_GTIDS": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "n[1-2]"},
        ["launch.nproc_per_node=2"], [2, 3]),
}


def table_ranks(stdout: str) -> list[int]:
    lines = stdout.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("rank ")))
    return [int(line.split()[0]) for line in lines[start + 1:] if line[:1].isdigit()]


@pytest.mark.slow
@pytest.mark.parametrize("env, args, ranks", LABELS.values(), ids=LABELS.keys())
def test_dry_run_labels_each_gpu_with_the_rank_that_runs_there(tmp_path, env, args, ranks):
    run = expgpu(["dry_run=true", "gpu_map=sequential", SIM4, *args], tmp_path / "run", env=clean_env(**env))
    assert run.returncode == 0, run.stderr
    assert table_ranks(run.stdout) == ranks
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [(r["rank"], r["local_rank"], r["gpus"]) for r in plan["ranks"]] == [
        (rank, local, [local]) for local, rank in enumerate(ranks)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_torchrun_with_2_and_1_workers_labels_both_nodes(tmp_path):
    # Two torchrun agents on this machine stand for two nodes; torch assigns the ranks itself.
    port = _free_port()
    procs = []
    for node, nproc in ((0, 2), (1, 1)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "expgpu", "dry_run=true", "gpu_map=sequential", SIM4, f"hydra.run.dir={tmp_path / str(node)}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=200) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [table_ranks(out) for out, _ in outs] == [[0, 1], [2]]
    plans = [json.loads((tmp_path / str(node) / "plan.json").read_text()) for node in (0, 1)]
    assert [[r["rank"] for r in p["ranks"]] for p in plans] == [[0, 1], [2]]
