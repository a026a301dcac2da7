"""Speed-proportional batches: the split, the sampler, the loss weighting, auto rebalancing.

Cheapest first: the pure split and sampler; then one DDP step on a real 2-rank gloo group;
then the CLI end to end (launch.nproc_per_node=2), where a rank made slower is rebalanced.
"""

from __future__ import annotations

import multiprocessing
import re
import sys
from collections import Counter

import pytest
import torch

from conftest import HELPERS, clean_env, expgpu
from expgpu.errors import UserError
from expgpu.train import proportional

# -- the split --------------------------------------------------------------------------------

@pytest.mark.parametrize("total,speeds,want", [
    (32, [3, 1], [24, 8]),
    (32, [1, 1], [16, 16]),
    (10, [1, 1, 1], [4, 3, 3]),           # leftover to the lower rank on a tie
    (8, [1000, 1, 1, 1], [5, 1, 1, 1]),   # a very slow rank still gets one example
    (128, [147.2, 46.3], [97, 31]),
])
def test_split_follows_speed_keeps_the_global_batch_and_gives_every_rank_one(total, speeds, want):
    sizes = proportional.split(total, speeds)
    assert sizes == want and sum(sizes) == total and min(sizes) >= 1


def test_split_refuses_what_cannot_be_split():
    with pytest.raises(ValueError):
        proportional.split(1, [1, 1])
    with pytest.raises(ValueError):
        proportional.split(8, [1, 0])


def test_loss_weight_is_b_r_times_w_over_b_for_means_and_one_for_sums():
    assert proportional.loss_weight([24, 8], 0) == 1.5 and proportional.loss_weight([24, 8], 1) == 0.5
    assert proportional.loss_weight([16, 16], 1) == 1.0
    assert proportional.loss_weight([24, 8], 0, "sum") == 1.0
    assert proportional.loss_reduction(torch.nn.MSELoss()) == "mean"
    assert proportional.loss_reduction(torch.nn.MSELoss(reduction="sum")) == "sum"
    with pytest.raises(UserError, match="reduction='none'"):
        proportional.loss_reduction(torch.nn.MSELoss(reduction="none"))


# -- the sampler ------------------------------------------------------------------------------

def _epoch(n, sizes, seed=0, epoch=0, start=0):
    return [list(proportional.ShareBatchSampler(n, sizes, r, seed, epoch, start)) for r in range(len(sizes))]


def test_an_epoch_covers_every_example_exactly_once_whatever_the_split():
    for sizes in ([24, 8], [16, 16], [5, 1, 2]):
        per_rank = _epoch(96, sizes, epoch=3)
        seen = Counter(i for batches in per_rank for b in batches for i in b)
        assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}, sizes
        assert [len(b) for b in per_rank[0]] == [sizes[0]] * (96 // sum(sizes))


def test_a_split_changed_mid_epoch_neither_repeats_nor_skips():
    # 2 global batches with 16+16, then 24+8 from global batch 2 on (what auto does)
    before = [b[:2] for b in _epoch(128, [16, 16])]
    after = _epoch(128, [24, 8], start=2)
    seen = Counter(i for part in (before, after) for batches in part for b in batches for i in b)
    assert sorted(seen) == list(range(128)) and set(seen.values()) == {1}


def test_global_batches_are_those_of_the_uniform_distributed_sampler():
    """Every mode trains on the same global batches in the same order: only who computes which
    part differs (so modes compare on the same work, and switching keeps exact data order)."""
    from torch.utils.data import DistributedSampler

    n, bs, ws = 96, 16, 2
    uniform = []
    for r in range(ws):
        s = DistributedSampler(range(n), num_replicas=ws, rank=r, shuffle=True, seed=7)
        s.set_epoch(2)
        idx = list(s)
        uniform.append([idx[k * bs:(k + 1) * bs] for k in range(len(idx) // bs)])
    weighted = _epoch(n, [24, 8], seed=7, epoch=2)
    for k in range(n // (bs * ws)):
        assert set(uniform[0][k] + uniform[1][k]) == set(weighted[0][k] + weighted[1][k])


def test_a_resumed_sampler_starts_at_its_global_batch():
    whole = _epoch(96, [24, 8])
    assert _epoch(96, [24, 8], start=1) == [b[1:] for b in whole]


# -- one DDP step on a real 2-rank gloo group ------------------------------------------------

CASES = [([16, 16], "mean", False), ([24, 8], "mean", False), ([24, 8], "mean", True),
         ([16, 16], "sum", False), ([24, 8], "sum", False)]


def _ddp_steps(rank, store, out):
    """Every case of CASES as one SGD step from the same start, in one gloo group of 2."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from expgpu.distributed import group as expgpu_dist
    from expgpu.tasks.models import MLP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
        for n, (sizes, reduction, measure) in enumerate(CASES):
            torch.manual_seed(0)
            model = MLP(8, 2, hidden=16)
            ddp = DistributedDataParallel(model)
            lo = sum(sizes[:rank])
            step = proportional.LocalStep(proportional.Split("proportional", list(sizes)), rank, 2, reduction,
                                   measure_steps=1 if measure else 0)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            opt.zero_grad()
            with step.step(ddp, sizes[rank]) as weight:
                loss = torch.nn.MSELoss(reduction=reduction)(ddp(x[lo:lo + sizes[rank]]), y[lo:lo + sizes[rank]])
                (loss * weight).backward()
            opt.step()
            torch.save(model.state_dict(), f"{out}.{n}.rank{rank}")
            del ddp
        dist.barrier()   # no rank tears the group down while the other still talks to it
    finally:
        dist.destroy_process_group()
        expgpu_dist._let_gloo_threads_finish()   # or this process may abort at exit (torch 2.13)


def _params_after_one_step(tmp_path) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    store, out = tmp_path / "store", tmp_path / "params"
    procs = [ctx.Process(target=_ddp_steps, args=(r, store, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    result = []
    for n in range(len(CASES)):
        params = [torch.load(f"{out}.{n}.rank{r}", weights_only=True) for r in range(2)]
        assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])   # DDP keeps ranks identical
        result.append(params[0])
    return result


def _close(a, b):
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_24_plus_8_reaches_the_parameters_of_16_plus_16_on_gloo(tmp_path):
    even, weighted, measuring, even_sum, weighted_sum = _params_after_one_step(tmp_path)
    assert _close(weighted, even)
    # auto's measuring steps (no_sync + gradients averaged by hand) are the same step
    assert _close(measuring, even)
    # a sum-reduced loss needs no weight: DDP's mean of per-rank sums is already uniform's
    assert _close(weighted_sum, even_sum)
    assert not _close(even_sum, even)   # (the two losses do differ: the checks above have teeth)


# -- the CLI end to end ----------------------------------------------------------------------

SGD_A = ["task=a", "task.optimizer._target_=torch.optim.SGD", "task.optimizer.lr=0.5", "task.max_steps=1",
         "task.batch_size=16", "checkpoint.resume=false"]


def _model(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["tracked"]["model"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_proportional_24_8_matches_uniform_16_16_and_one_rank_of_32(tmp_path):
    two = ["launch.nproc_per_node=2"]
    uniform = expgpu(SGD_A + two, tmp_path / "uniform")
    proportional = expgpu(SGD_A + two + ["data.shard=proportional", "data.weights=[3,1]"], tmp_path / "prop")
    single = expgpu([*SGD_A[:-2], "task.batch_size=32", "checkpoint.resume=false"], tmp_path / "single")
    for run in (uniform, proportional, single):
        assert run.returncode == 0, run.stderr
    assert proportional.result["shard"]["sizes"] == [24, 8] and uniform.result["shard"]["sizes"] == [16, 16]
    assert "data.shard=proportional: split rank 0 -> 24, rank 1 -> 8" in proportional.output
    assert _close(_model(tmp_path / "prop"), _model(tmp_path / "uniform"))
    assert _close(_model(tmp_path / "prop"), _model(tmp_path / "single"))
    # the test has teeth: the same split without the loss weight lands elsewhere
    run = expgpu(SGD_A + two + ["data.shard=proportional", "data.weights=[3,1]",
                                "task.loss={_target_:shard_probe.MeanClaimingSum}"], tmp_path / "unweighted",
                 env=clean_env(PYTHONPATH=str(HELPERS)))
    assert run.returncode == 0, run.stderr
    assert not _close(_model(tmp_path / "unweighted"), _model(tmp_path / "uniform"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_accumulating_with_unequal_batches_matches_uniform(tmp_path):
    # 2 optimizer steps of 2 micro-batches, each micro-batch a global batch of 32: split 24 + 8,
    # split 16 + 16 while auto measures (gradients averaged by hand after every micro-batch), and
    # 16 + 16 under DDP all reach the same parameters
    acc = [*SGD_A[:3], "task.max_steps=2", "task.batch_size=16", "task.accumulate=2", "checkpoint.resume=false",
           "launch.nproc_per_node=2"]
    uniform = expgpu(acc, tmp_path / "uniform")
    proportional = expgpu(acc + ["data.shard=proportional", "data.weights=[3,1]"], tmp_path / "prop")
    measuring = expgpu(acc + ["data.shard=auto", "data.auto_steps=5"], tmp_path / "auto")
    for run in (uniform, proportional, measuring):
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.result["rank_checksums"][0] == run.result["rank_checksums"][1]
    assert proportional.result["shard"]["sizes"] == [24, 8]
    assert measuring.result["shard"]["measured"] is False   # 2 steps: still inside the 5-step window
    assert _close(_model(tmp_path / "prop"), _model(tmp_path / "uniform"))
    assert _close(_model(tmp_path / "auto"), _model(tmp_path / "uniform"))
    # the test has teeth: one micro-batch per step lands elsewhere
    one = expgpu([*acc[:5], "task.accumulate=1", *acc[6:], "data.shard=proportional", "data.weights=[3,1]"],
                 tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    assert not _close(_model(tmp_path / "one"), _model(tmp_path / "uniform"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_auto_with_accumulation_measures_data_auto_steps_optimizer_steps(tmp_path):
    run = expgpu(["task=a", "task.max_steps=6", "task.batch_size=16", "task.accumulate=2", "launch.nproc_per_node=2",
                  "data.shard=auto", "data.auto_steps=3", "faults.slow_rank=1", "faults.slow_factor=8",
                  "checkpoint.resume=false"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["shard"]["measured"] is True
    line = re.search(r"rebalanced split: rank 0 -> (\d+), rank 1 -> (\d+) .* over (\d+) batches", run.output)
    assert line and int(line[3]) == 6, run.output[-2000:]   # 3 optimizer steps x 2 micro-batches
    assert [int(line[1]), int(line[2])] == run.result["shard"]["sizes"]
    assert run.result["rank_checksums"][0] == run.result["rank_checksums"][1]


@pytest.mark.slow
def test_cli_proportional_splits_by_simulated_gpu_scores(tmp_path):
    sim = "inventory.simulate=[{name:A100,memory_mb:40960,score:3},{name:V100,memory_mb:16384,score:1}]"
    run = expgpu(["task=a", "task.max_steps=5", "task.batch_size=16", "launch.nproc_per_node=2",
                  "data.shard=proportional", "gpu_map=ranked", sim], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert run.result["shard"]["sizes"] == [24, 8]
    assert run.result["rank_checksums"][0] == run.result["rank_checksums"][1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_auto_rebalances_a_slow_rank_and_still_covers_each_example_once_per_epoch(tmp_path):
    logs = tmp_path / "fetched"
    # 256 examples, global batch 32: 8 steps an epoch; measured over 3 steps, then rebalanced
    # mid-epoch; 16 steps = 2 epochs. Each example also takes 1 ms of "device" time (a sleep, x8 on
    # rank 1): the measurement then sees the ranks' speeds, not how busy the test's neighbours
    # keep the 2 cores (which made rank 0's few ms of CPU look as slow as rank 1's, [18, 14]).
    run = expgpu(["task=a", "task.max_steps=16", "task.batch_size=16", "launch.nproc_per_node=2",
                  "task.dataset._target_=shard_probe.IndexLog", f"+task.dataset.log_dir={logs}",
                  "task.dataset.size=256", "data.shard=auto", "data.auto_steps=3",
                  "faults.slow_rank=1", "faults.slow_factor=8", "faults.device_ms_per_example=1",
                  "checkpoint.resume=false"],
                 tmp_path / "run", env=clean_env(PYTHONPATH=str(HELPERS)))
    assert run.returncode == 0, run.stderr
    sizes = run.result["shard"]["sizes"]
    assert run.result["shard"]["mode"] == "auto" and run.result["shard"]["measured"] is True
    line = re.search(r"rebalanced split: rank 0 -> (\d+), rank 1 -> (\d+)", run.output)
    assert line and [int(line[1]), int(line[2])] == sizes
    assert sum(sizes) == 32 and sizes[0] >= 2 * sizes[1], sizes   # rank 1 is ~8x slower
    assert run.result["rank_checksums"][0] == run.result["rank_checksums"][1]
    # rank r fetched 16 per step for 3 steps, then sizes[r] per step
    fetched = {r: [int(s) for s in (logs / f"rank{r}.txt").read_text().split()] for r in (0, 1)}
    steps = {r: [fetched[r][16 * k:16 * (k + 1)] for k in range(3)] for r in (0, 1)}
    for r in (0, 1):
        rest = fetched[r][48:]
        assert len(rest) == 13 * sizes[r]
        steps[r] += [rest[sizes[r] * k:sizes[r] * (k + 1)] for k in range(13)]
    for epoch in (0, 1):
        seen = Counter(i for r in (0, 1) for b in steps[r][8 * epoch:8 * (epoch + 1)] for i in b)
        assert sorted(seen) == list(range(256)) and set(seen.values()) == {1}, epoch


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_a_resumed_run_keeps_the_checkpoints_split(tmp_path):
    base = ["task=a", "task.batch_size=16", "launch.nproc_per_node=2", "data.shard=proportional"]
    straight = expgpu(base + ["task.max_steps=20", "data.weights=[3,1]"], tmp_path / "straight")
    first = expgpu(base + ["task.max_steps=10", "data.weights=[3,1]"], tmp_path / "resumed")
    # other weights now: the checkpoint's split wins, so the run continues exactly
    second = expgpu(base + ["task.max_steps=20", "data.weights=[1,1]"], tmp_path / "resumed")
    for run in (straight, first, second):
        assert run.returncode == 0, run.stderr
    assert second.result["resumed_from_step"] == 10 and second.result["shard"]["sizes"] == [24, 8]
    assert second.result["param_checksum"] == straight.result["param_checksum"]
    other = expgpu(base[:-1] + ["task.max_steps=30"], tmp_path / "resumed")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1].startswith("expgpu: error: data.shard=uniform: the checkpoint")


@pytest.mark.parametrize("args,says", [
    (["data.shard=proportional", "data.weights=[3]"], "data.weights=[3.0] has 1 entries but the run has 2 ranks"),
    (["data.shard=proportional"], "data.shard=proportional: rank 0 has no GPU score"),
    (["data.shard=auto", "data.weights=[0,1]"], "data.weights="),
    (["data.shard=auto", "data.auto_steps=1"], "data.auto_steps=1 is not allowed"),
    (["faults.slow_rank=1", "faults.slow_factor=0.5"], "faults.slow_factor=0.5 is not allowed"),
    (["faults.device_ms_per_example=-1"], "faults.device_ms_per_example=-1.0 is not allowed"),
])
@pytest.mark.slow
def test_cli_bad_shard_settings_are_one_line_and_exit_2(tmp_path, args, says):
    run = expgpu(["task=a", "task.max_steps=5", "launch.nproc_per_node=2"] + args, tmp_path / "run")
    assert run.returncode == 2, run.output
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: error:") and says in last, last
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_data_shard_is_a_no_op_on_one_rank_and_resumes(tmp_path):
    run = expgpu(["task=a", "task.max_steps=5", "data.shard=auto"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert run.result["shard"]["mode"] == "uniform"
    again = expgpu(["task=a", "task.max_steps=10", "data.shard=auto"], tmp_path / "run")
    assert again.returncode == 0, again.stderr
    assert again.result["resumed_from_step"] == 5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
