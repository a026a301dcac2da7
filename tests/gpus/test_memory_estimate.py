"""The dry run's memory per rank for parameters and optimizer state (expgpu.gpus.memory_estimate):
ddp holds the whole model and optimizer state on every rank, fsdp 1/world of each."""

from __future__ import annotations

import pytest

from conftest import clean_env, expgpu
from expgpu.gpus import memory_estimate as me

MLP_A = {"_target_": "expgpu.tasks.models.MLP", "in_features": 32, "out_features": 4, "hidden": 128}


@pytest.mark.parametrize("optimizer,states", [
    ({"_target_": "torch.optim.Adam", "lr": 1e-3}, 2),
    ({"_target_": "torch.optim.AdamW"}, 2),
    ({"_target_": "torch.optim.Adam", "amsgrad": True}, 3),
    ({"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}, 1),
    ({"_target_": "torch.optim.SGD", "lr": 0.1}, 0),
    ({"_target_": "torch.optim.LBFGS"}, None),
    (None, None),
])
def test_optimizer_state_per_parameter(optimizer, states):
    assert me.optimizer_states(optimizer)[0] == states


def test_ddp_holds_everything_on_every_rank_and_fsdp_a_world_th():
    est = me.Estimate(param_bytes=1000, params=250, model="M", opt_bytes=2000, optimizer="Adam")
    assert est.per_rank(4, "ddp") == (1000, 2000)
    assert est.per_rank(4, "fsdp") == (250, 500)
    assert est.per_rank(3, "fsdp") == (334, 667)   # a shard rounds up
    assert est.per_rank(1, "fsdp") == (1000, 2000)


def test_the_built_in_models_parameters_are_counted_on_the_meta_device():
    est = me.count({"model": MLP_A, "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True}})
    # MLP 32 -> 128 -> 128 -> 4 (expgpu.tasks.models): weights and biases
    n = 32 * 128 + 128 + 128 * 128 + 128 + 128 * 4 + 4
    assert (est.params, est.param_bytes, est.opt_bytes, est.model) == (n, 4 * n, 2 * 4 * n, "MLP")
    line = me.line(est, 2)
    assert line == (f"memory per rank for parameters + optimizer state, 2 rank(s): ddp 249.0 KiB (83.0 KiB + "
                    f"166.0 KiB), fsdp 124.5 KiB (41.5 KiB + 83.0 KiB); MLP: {n:,} parameters, Adam")


def test_what_cannot_be_known_is_unknown_not_guessed():
    assert me.line(me.measure({"_target_": "my.train", "lr": 0.1}), 2).endswith(
        "2 rank(s): unknown (a task function builds its own model)")
    assert me.line(me.measure({"script": "train.py", "args": {}}), 2).endswith(
        "unknown (a script task builds its own model)")
    est = me.count({"model": MLP_A, "optimizer": {"_target_": "torch.optim.LBFGS"}})
    line = me.line(est, 2)
    assert "ddp unknown (83.0 KiB + unknown)" in line and "the state of LBFGS is not known" in line


def test_dry_run_shows_each_ranks_memory_under_ddp_and_fsdp(tmp_path):
    # 4 CPU ranks on any machine (a node with 1-3 GPUs would refuse 4 ranks under gpu_map=sequential)
    run = expgpu(["dry_run=true", "task=a", "launch.nproc_per_node=4"], tmp_path / "run",
                 env=clean_env(CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 0, run.stderr
    lines = [x for x in run.stdout.splitlines() if x.startswith("memory per rank")]
    assert lines == ["memory per rank for parameters + optimizer state, 4 rank(s): ddp 249.0 KiB (83.0 KiB + "
                     "166.0 KiB), fsdp 62.3 KiB (20.8 KiB + 41.5 KiB); MLP: 21,252 parameters, Adam"], run.stdout


def test_a_sweeps_tasks_are_counted_together_each_its_own():
    adam = {"_target_": "torch.optim.Adam", "_partial_": True}
    wide = dict(MLP_A, hidden=256)
    tasks = [{"model": MLP_A, "optimizer": adam}, {"_target_": "my.train"}, {"model": wide, "optimizer": adam},
             {"model": MLP_A, "optimizer": adam, "batch_size": 32}]
    got = me.measure_many(tasks)
    assert [e.params for e in got] == [21252, None, 32 * 256 + 256 + 256 * 256 + 256 + 256 * 4 + 4, 21252]
    assert got[1].why == "a task function builds its own model"
