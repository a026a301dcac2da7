"""Resuming on another number of ranks (expgpu.checkpoint.world_change): the same global batch, the same
global sample sequence, one line for what cannot be carried over.

The sampler tests are pure. The others are real gloo runs on the CPU: a run stopped at 2 ranks
resumes at 1 (and 1 -> 2) and trains on exactly the samples, step for step, that the
uninterrupted run trains on (tests/helpers/world_probe.py writes the ids of every step's samples), with
its loss curve within float tolerance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from probes import error_line

from conftest import HELPERS, TESTS, Run, clean_env, expgpu
from expgpu.checkpoint import world_change
from expgpu.train.batches import RankSampler

PROBE_ENV = clean_env(PYTHONPATH=str(HELPERS))


# -- the mapping, pure -------------------------------------------------------------------------

def _step_batches(n: int, world: int, batch: int, epoch: int, skip: int) -> list[list[int]]:
    """Every step's global batch (all ranks' samples, sorted) from batch `skip` of the epoch on."""
    shares = []
    for rank in range(world):
        s = RankSampler(n, world, rank, shuffle=True, seed=3, drop_last=True, batch_size=batch)
        s.set_epoch(epoch)
        s.skip(skip)
        length = len(s)
        mine = list(s)
        assert len(mine) == length
        shares.append([mine[i:i + batch] for i in range(0, len(mine) - batch + 1, batch)])
    steps = min(len(b) for b in shares)
    assert all(len(b) == steps for b in shares), "ranks would take unequal numbers of steps"
    return [sorted(i for b in shares for i in b[k]) for k in range(steps)]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (4, 2), (2, 4), (3, 6)])
@pytest.mark.parametrize("n", [200, 203])
def test_a_resumed_epoch_continues_the_global_sample_sequence_on_any_world(before, after, n):
    global_batch = 12
    straight = _step_batches(n, before, global_batch // before, epoch=1, skip=0)
    assert len(straight) == n // global_batch   # the tail that fills no global batch is left out, as today
    for stopped_at in (0, 5, len(straight)):
        resumed = _step_batches(n, after, global_batch // after, epoch=1, skip=stopped_at)
        assert resumed == straight[stopped_at:], (before, after, stopped_at)


def test_the_same_world_size_takes_the_very_batches_it_took_before():
    """A position is a global offset now; at the same world size each rank's batches are unchanged."""
    s = RankSampler(100, 2, 1, shuffle=True, seed=0, drop_last=True, batch_size=4)
    everything = list(s)
    s.skip(3)
    assert list(s) == everything[12:] and len(everything) == 50


def test_per_rank_batch_and_the_one_line_when_the_world_does_not_divide_it():
    assert world_change.rank_batch(8, start=2, world=1) == 16
    assert world_change.rank_batch(8, start=2, world=4) == 4
    assert world_change.rank_batch(8, start=2, world=3) is None
    line = world_change.indivisible("task.batch_size", 8, 2, 3)
    assert "global batch of 16, which 3 ranks cannot share equally" in line and "(1, 2, 4, 8, 16)" in line


def test_per_rank_values_carry_over_only_when_every_rank_held_the_same():
    import torch

    from expgpu.errors import UserError

    same = {"ranks": [{"tracked": {"c": {"n": torch.tensor([1, 2]), "best": 0.5}}}] * 2}
    assert world_change.own_value(same, "c", rank=0, world=1, path="ck").keys() == {"n", "best"}
    differ = {"ranks": [{"tracked": {"keep:run.steps": {"h": torch.tensor([float(r)])}}} for r in range(2)]}
    assert world_change.own_value(differ, "keep:run.steps", rank=1, world=2, path="ck")["h"].item() == 1.0
    with pytest.raises(UserError, match="its 2 ranks each hold their own keep= variables of run.steps"):
        world_change.own_value(differ, "keep:run.steps", rank=0, world=1, path="ck")


def test_a_new_rank_is_reseeded_from_seed_step_and_rank():
    assert world_change.reseed_value(0, 7, 1, True) == world_change.reseed_value(0, 7, 0, True) + 1
    assert world_change.reseed_value(0, 7, 1, False) == world_change.reseed_value(0, 7, 0, False)
    assert world_change.reseed_value(0, 8, 0, True) != world_change.reseed_value(0, 7, 0, True)


# -- real runs ---------------------------------------------------------------------------------

STEPS = 30   # 200 samples, a global batch of 16: 12 steps an epoch, so the run crosses two epochs
STOP = 7     # mid-epoch


def probe(args: list[str], run_dir: Path) -> Run:
    run = expgpu(["--config-dir", str(TESTS / "conf"), "task=probe_world", "task.log_every=1", *args], run_dir,
                 env=PROBE_ENV)
    return run


def _ids(run_dir: Path, world: str = "w") -> dict[int, list[int]]:
    """step -> the sorted ids of every rank's samples at that step (the runs in the dir on `world`
    ranks: "w2", "w1"; all of them by default)."""
    steps: dict[int, list[int]] = {}
    for f in sorted(run_dir.glob(f"ids.rank*.{world}*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            steps.setdefault(row["step"], []).extend(row["ids"])
    return {s: sorted(ids) for s, ids in sorted(steps.items())}


def _losses(run: Run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.metrics()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted runs: 2 ranks x 8 and 1 rank x 16 (the same global batch)."""
    runs = {}
    for world, batch in ((2, 8), (1, 16)):
        run = probe([f"launch.nproc_per_node={world}", f"task.batch_size={batch}"],
                    tmp_path_factory.mktemp(f"straight{world}") / "run")
        assert run.returncode == 0, run.stderr[-3000:]
        runs[world] = run
    return runs


@pytest.mark.slow
def test_the_uninterrupted_runs_on_1_and_2_ranks_take_the_same_global_batches(straight):
    one, two = _ids(straight[1].run_dir), _ids(straight[2].run_dir)
    assert list(one) == list(range(STEPS)) and one == two
    for epoch in range(2):   # each sample at most once an epoch
        seen = [i for s in range(12 * epoch, 12 * epoch + 12) for i in one[s]]
        assert len(seen) == len(set(seen)) == 12 * 16


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (4, 2)], ids=["2-to-1", "1-to-2", "4-to-2"])
def test_stopped_on_one_world_size_resumed_on_another_trains_on_the_same_samples(tmp_path, straight, before,
                                                                                after):
    run_dir = tmp_path / "run"
    first = probe([f"launch.nproc_per_node={before}", f"task.batch_size={16 // before}",
                   f"task.max_steps={STOP}"], run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    # task.batch_size is per rank at the run's start: the same value, a share of the same global batch now
    resumed = probe([f"launch.nproc_per_node={after}", f"task.batch_size={16 // before}"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    res = resumed.result
    assert res["resumed_from_step"] == STOP and res["world_size"] == after and res["steps"] == STEPS
    assert res["metrics"]["batch"] == res["metrics"]["rank_batch"] == 16 // after
    assert res["metrics"]["start_world"] == before and first.result["metrics"]["start_world"] == before
    assert len({r["param_checksum"] for r in res["plan"]}) == 1
    ref = straight[min(before, 2)]   # 4 ranks x 4 take the same global batches as 2 x 8 (asserted above)
    assert _ids(run_dir) == _ids(ref.run_dir)   # no sample repeated or skipped, step for step
    want, got = _losses(ref), _losses(resumed)
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=1e-4, abs_tol=1e-6), (step, got[step], want[step])
    assert math.isclose(res["metrics"]["loss"], ref.result["metrics"]["loss"], rel_tol=1e-4)


def _error(run: Run) -> str:
    last = error_line(run)
    assert last.startswith("expgpu: error: checkpoint "), run.stderr[-3000:]
    return last


@pytest.mark.slow
def test_a_world_size_that_does_not_divide_the_global_batch_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    assert probe(["task.batch_size=5", "task.max_steps=3"], run_dir).returncode == 0
    before = (run_dir / "checkpoint.pt").read_bytes()
    line = _error(probe(["task.batch_size=5", "launch.nproc_per_node=2"], run_dir))
    assert "run.loader batch_size=5 per rank x 1 rank(s) at its start = a global batch of 5, which 2 ranks " \
           "cannot share equally" in line, line
    assert (run_dir / "checkpoint.pt").read_bytes() == before
    # another task's checkpoint: that is what the line says, not how its batch would divide
    line = _error(expgpu(["task=a", "task.batch_size=5", "launch.nproc_per_node=2"], run_dir))
    assert "was written with task='probe_world', this run has task='a'" in line, line


@pytest.mark.slow
def test_per_rank_values_that_differ_between_ranks_are_one_line_on_another_world(tmp_path):
    run_dir = tmp_path / "run"
    assert probe(["launch.nproc_per_node=2", "task.own=true", "task.max_steps=3"], run_dir).returncode == 0
    line = _error(probe(["task.own=true"], run_dir))
    assert "its 2 ranks each hold their own run.track(counts=...) and the values differ" in line, line
    assert "resume with 2 ranks" in line


@pytest.mark.slow
@pytest.mark.parametrize("shard", [[], ["data.shard=proportional", "data.weights=[3,1]"]],
                         ids=["uniform", "proportional"])
def test_the_built_in_loop_stopped_at_2_ranks_ends_at_1_where_the_uninterrupted_run_does(tmp_path, shard):
    """data.shard=proportional slices the same global batches: 2 ranks split 96 + 32, 1 takes all 128."""
    base = ["task=a", "task.log_every=5"]
    ref = expgpu(base + shard + ["launch.nproc_per_node=2", "task.max_steps=60"], tmp_path / "ref")
    first = expgpu(base + shard + ["launch.nproc_per_node=2", "task.max_steps=25"], tmp_path / "run")
    resumed = expgpu(base + shard[:1] + ["task.max_steps=60"], tmp_path / "run")
    for run in (ref, first, resumed):
        assert run.returncode == 0, run.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == 25 and resumed.result["world_size"] == 1
    assert "task.batch_size 128 (its share of 64 x 2 at the start) x 1 rank(s) = 128" in resumed.result["step_means"]
    assert math.isclose(resumed.result["metrics"]["final_loss"], ref.result["metrics"]["final_loss"], rel_tol=1e-4)


@pytest.mark.slow
def test_an_epoch_loop_crashed_at_2_ranks_resumes_at_1_from_its_periodic_checkpoint(tmp_path, straight):
    """run.epochs: the periodic checkpoint at step 5 lies mid-epoch; the steps after it that the
    crashed run did are redone on 1 rank with the same samples."""
    run_dir = tmp_path / "run"
    crashed = probe(["launch.nproc_per_node=2", "task.epochs=3", "checkpoint.every_steps=5",
                     "faults.crash_rank=1", "faults.crash_step=8", "backend.timeout_s=30"], run_dir)
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    resumed = probe(["task.epochs=3"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == 5 and resumed.result["steps"] == 36
    before = {s: ids for s, ids in _ids(run_dir, "w2").items() if s < 5}
    after = _ids(run_dir, "w1")
    assert min(after) == 5
    got, ref = {**before, **after}, _ids(straight[2].run_dir)   # the straight run: 30 steps of the same epochs
    assert list(got) == list(range(36)) and {s: got[s] for s in range(STEPS)} == ref
    last_epoch = [i for s in range(24, 36) for i in got[s]]
    assert len(last_epoch) == len(set(last_epoch)) == 12 * 16


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_an_fsdp_run_resumed_on_another_world_size_reshards_and_trains_on_the_same_samples(tmp_path, straight,
                                                                                         before, after):
    """launch.wrap=fsdp: the sharded checkpoint (checkpoint/, DCP) written by `before` ranks is read by
    `after` ranks, each taking its own shards of the same parameters and Adam state."""
    run_dir, fsdp = tmp_path / "run", ["launch.wrap=fsdp"]
    first = probe([*fsdp, f"launch.nproc_per_node={before}", f"task.batch_size={16 // before}",
                   f"task.max_steps={STOP}"], run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run_dir / "checkpoint" / ".metadata").exists() and not (run_dir / "checkpoint.pt").exists()
    resumed = probe([*fsdp, f"launch.nproc_per_node={after}", f"task.batch_size={16 // before}"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    res = resumed.result
    assert res["resumed_from_step"] == STOP and res["world_size"] == after and res["steps"] == STEPS
    ref = straight[before]   # ddp: fsdp computes the same sums in another order, so within tolerance
    assert _ids(run_dir) == _ids(ref.run_dir)
    want, got = _losses(ref), _losses(resumed)
    assert list(got) == list(want)
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=1e-3, abs_tol=1e-5), (step, got[step], want[step])
