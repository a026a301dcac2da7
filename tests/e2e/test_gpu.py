"""On a real GPU node (skipped without one): the same CLI, on CUDA, with nccl where it applies."""

from __future__ import annotations

import pytest

from conftest import REPO, clean_env, expgpu

pytestmark = pytest.mark.gpu


def _gpu_count() -> int:
    from expgpu.gpus import inventory

    return len(inventory())


def test_single_rank_trains_on_its_gpu(tmp_path):
    run = expgpu(["task=a", "task.max_steps=60", "gpu_map=ranked"], tmp_path / "run", env=clean_env())
    assert run.returncode == 0, run.stderr
    res = run.result
    assert res["plan"][0]["device"] == "cuda:0" and len(res["plan"][0]["gpus"]) == 1
    losses = [m["loss"] for m in run.metrics()]
    assert losses[-1] < losses[0]
    # its peak GPU memory: what the allocator held, at least what tensors used; in its last line too
    plan = res["plan"][0]
    assert 0 < plan["gpu_peak_allocated_mb"] <= plan["gpu_peak_reserved_mb"] < 80 * 1024, plan
    assert "; GPU memory peak " in run.stderr + run.stdout


def test_the_last_gpu_is_the_only_one_the_process_sees(tmp_path):
    last = _gpu_count() - 1
    run = expgpu(["task=a", "task.max_steps=20", "gpu_map=custom", f"gpu_map.gpus=[{last}]"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert run.result["plan"][0]["gpus"] == [last] and run.result["plan"][0]["device"] == "cuda:0"


def test_two_ranks_sharing_one_gpu_fall_back_to_gloo(tmp_path):
    run = expgpu(["task=b", "task.max_steps=30", "launch.nproc_per_node=2", "gpu_map.share=true",
                  "gpu_map=custom", "gpu_map.gpus=[0,0]"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    res = run.result
    assert res["backend"] == "gloo" and res["rank_checksums"][0] == res["rank_checksums"][1]


def test_nccl_refuses_two_ranks_on_one_gpu(tmp_path):
    run = expgpu(["task=a", "launch.nproc_per_node=2", "gpu_map.share=true", "gpu_map=custom",
                  "gpu_map.gpus=[0,0]", "backend=nccl"], tmp_path / "run")
    assert run.returncode == 2 and "backend=nccl" in run.stderr and "Traceback" not in run.stderr


def test_two_gpus_two_ranks_over_nccl(tmp_path):
    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    run = expgpu(["task=b", "task.max_steps=40", "launch.nproc_per_node=2"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    res = run.result
    assert res["backend"] == "nccl" and res["rank_checksums"][0] == res["rank_checksums"][1]
    assert sorted(g for r in res["plan"] for g in r["gpus"]) == [0, 1]


def test_a_loop_waits_for_data_only_when_the_gpu_ran_out_of_work(tmp_path):
    """data_wait counts a batch's fetch only when the GPU had drained by its end: a loop the GPU holds back reads
    its next batch while the GPU computes (no wait), one the loader holds back leaves the GPU idle."""
    probe = ["--config-dir", str(REPO / "tests" / "conf"), "task=probe_data_bound"]
    env = clean_env(PYTHONPATH=str(REPO / "tests" / "helpers"))
    gpu_bound = expgpu(probe + ["task.item_ms=1", "task.matmuls=20"], tmp_path / "gpu", env=env)
    data_bound = expgpu(probe + ["task.item_ms=5", "task.matmuls=0"], tmp_path / "data", env=env)
    for run in (gpu_bound, data_bound):
        assert run.returncode == 0, run.stderr[-3000:]
    assert gpu_bound.result["timing"]["data_wait"] < 0.1, gpu_bound.result["timing"]
    assert data_bound.result["timing"]["data_wait"] > 0.7, data_bound.result["timing"]
