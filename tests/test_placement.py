"""The node plan as a process sees it: pinned by its launcher, or shared by local rank 0."""

from __future__ import annotations

import json
import threading

from expgpu import placement
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
    path = placement.plan_path(tmp_path, "torchrun-r1-0")
    assert json.loads(path.read_text())["strategy"] == "free_memory"


def test_a_restart_does_not_read_the_previous_launch_plan(tmp_path):
    env0 = {"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "0"}
    placement.shared(cfg("sequential"), info(0), tmp_path, 5, env=env0)
    assert placement.launch_id({**env0, "TORCHELASTIC_RESTART_COUNT": "1"}) != placement.launch_id(env0)


def test_dry_run_table_shows_rank_host_gpu_name_memory_score():
    node = placement.compute(cfg("ranked"), 2)
    rows = placement.rows(node, node_rank=1, host="n1")
    assert [r["rank"] for r in rows] == [2, 3] and rows[0]["host"] == "n1"
    text = placement.table(rows, "ranked")
    assert "A100" in text and "40 GiB" in text and text.splitlines()[1].split()[:4] == ["rank", "host", "local", "gpu"]
