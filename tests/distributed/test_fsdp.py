"""launch.wrap=fsdp and the sharded checkpoint (checkpoint.format=dcp).

Fast: the units fully_shard gets, the config's one-line refusals, a DCP checkpoint written in this
process then torn. Slow (real 2-rank gloo groups, the real CLI): FSDP trains as DDP does (plain,
accumulating, clipping), each rank holds half the bytes, a stop resumes bitwise, two models and
two optimizers, a checkpoint of one wrap resumed under the other, and each bad input as one line.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from config_compose import refused
from probes import error_line

from conftest import HELPERS, TESTS, Run, clean_env, expgpu, finish, start, wait_for_progress
from expgpu.checkpoint import sharded
from expgpu.distributed import fsdp
from expgpu.errors import UserError

pytestmark = pytest.mark.timeout(240)

PROBE_ENV = clean_env(PYTHONPATH=str(HELPERS))
TWO = ["launch.nproc_per_node=2", "backend.timeout_s=60"]


# -- fast: units, config, the checkpoint directory -------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU()


def test_default_units_are_the_direct_children_that_hold_parameters_deepest_first():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert fsdp.unit_modules(model, None) == [model[2], model[0]]


def test_units_by_class_name_come_bottom_up():
    model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(4, 1))
    assert fsdp.unit_modules(model, ["Block"]) == [model[1], model[0]]
    linears = fsdp.unit_modules(model, ["Linear"])
    assert linears == [model[2], model[1].inner, model[0].inner]


def test_a_unit_class_the_model_lacks_is_one_line_listing_the_classes_it_has():
    model = torch.nn.Sequential(Block(), torch.nn.Linear(4, 1))
    with pytest.raises(UserError) as e:
        fsdp.unit_modules(model, ["Block", "TransformerBlock"])
    assert str(e.value) == ("launch.fsdp.units=['Block', 'TransformerBlock']: the model has no TransformerBlock; "
                            "its module classes are Block, Linear, ReLU, Sequential")


BAD = {
    "fsdp with dp's GPUs per rank": (["launch.wrap=fsdp", "gpu_map.gpus_per_rank=2"],
                                     "gpu_map.gpus_per_rank=2 is not allowed: 1 with launch.wrap=fsdp"),
    "fsdp with the single-file format": (["launch.wrap=fsdp", "checkpoint.format=pt"],
                                         "checkpoint.format=pt is not allowed: auto or dcp"),
    "fsdp settings under ddp": (["launch.fsdp.cpu_offload=true"],
                                "launch.fsdp.cpu_offload=true is not allowed: set only with launch.wrap=fsdp"),
    "async without dcp": (["checkpoint.async_save=true"], "checkpoint.async_save=true is not allowed: true only"),
    "no units": (["launch.wrap=fsdp", "launch.fsdp.units=[]"], "launch.fsdp.units=[] is not allowed"),
}


@pytest.mark.parametrize("overrides, needle", BAD.values(), ids=BAD.keys())
def test_each_fsdp_mistake_is_one_line_naming_it(overrides, needle):
    line = refused(*overrides)
    assert needle in line and "\n" not in line, line


def _saved_here(path: Path) -> tuple[sharded.ShardedCheckpoint, dict]:
    """A DCP checkpoint of a model and its optimizer written by this process (no group: one rank)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    ckpt = sharded.ShardedCheckpoint(path, 0, 1, asynchronous=False, timeout_s=30)
    ckpt.save(7, {"rank": "own"}, {"step": 7}, {"model": model, "opt": opt}, background=False)
    return ckpt, {"model": model, "opt": opt}


def test_a_sharded_checkpoint_is_renamed_into_place_and_reads_back(tmp_path):
    ckpt, objects = _saved_here(tmp_path)
    assert ckpt.where() == tmp_path / "checkpoint" and not list(tmp_path.glob(".checkpoint.*"))
    meta = torch.load(ckpt.meta_path(ckpt.where()), weights_only=True)
    assert meta["step"] == 7 and meta["ranks"] == [{"rank": "own"}]
    want = {k: v.clone() for k, v in objects["model"].state_dict().items()}
    with torch.no_grad():
        for p in objects["model"].parameters():
            p.add_(1.0)
    ckpt.restore(ckpt.where(), objects, empty=[])
    assert all(torch.equal(v, want[k]) for k, v in objects["model"].state_dict().items())


@pytest.mark.parametrize("tear, needle", [
    (lambda d: (d / ".metadata").unlink(), "it has no .metadata (its save was cut off)"),
    (lambda d: (d / "expgpu.pt").unlink(), "it has no expgpu.pt"),
    (lambda d: (d / "__0_0.distcp").unlink(), "the shard __0_0.distcp is missing"),
    (lambda d: (d / "__0_0.distcp").write_bytes(b"x"), "the shard __0_0.distcp is truncated"),
], ids=["no metadata", "no expgpu.pt", "shard missing", "shard truncated"])
def test_a_torn_sharded_checkpoint_is_an_error_naming_it(tmp_path, tear, needle):
    ckpt, _ = _saved_here(tmp_path)
    tear(tmp_path / "checkpoint")
    with pytest.raises(UserError) as e:
        ckpt.meta_path(ckpt.where())
    assert str(e.value).startswith(f"checkpoint {tmp_path / 'checkpoint'} is incomplete") and needle in str(e.value)


def test_another_model_shape_names_the_first_mismatched_key_and_both_shapes():
    metadata = SimpleNamespace(state_dict_metadata={"gen.0.weight": SimpleNamespace(size=torch.Size([16, 16])),
                                                    "gen.0.bias": SimpleNamespace(size=torch.Size([16]))})
    state = {"gen": {"0.weight": torch.zeros(8, 16), "0.bias": torch.zeros(16)}}
    with pytest.raises(UserError) as e:
        sharded.check_shapes(Path("ck"), metadata, state, owners={})
    assert "gen.0.weight has shape [16, 16] there, [8, 16] in this run's gen" in str(e.value)


# -- slow: two ranks through the CLI -------------------------------------------------------------

def probe(args: list[str], run_dir: Path, env: dict | None = None, **kw) -> Run:
    return expgpu(["--config-dir", str(TESTS / "conf"), *args], run_dir, env=env or PROBE_ENV, **kw)


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["status"] == "finished"
    assert len(set(run.result["rank_checksums"])) == 1, run.result["rank_checksums"]
    return run


def _rows(run: Run) -> dict[int, dict]:
    return {r["step"]: r for r in run.metrics()}


def _close(a: Run, b: Run, keys: tuple[str, ...], rel: float = 1e-5) -> None:
    ra, rb = _rows(a), _rows(b)
    assert ra.keys() == rb.keys() and len(ra) >= 20
    for step in ra:
        for key in keys:
            assert math.isclose(ra[step][key], rb[step][key], rel_tol=rel, abs_tol=1e-7), (step, key, ra[step],
                                                                                            rb[step])


@pytest.mark.slow
@pytest.mark.parametrize("extra, keys", [
    ([], ("loss",)),
    (["task.accumulate=2", "task.clip_grad_norm=0.05"], ("loss", "grad_norm")),
], ids=["plain", "accumulate-and-clip"])
def test_fsdp_on_two_ranks_trains_as_ddp_does(tmp_path, extra, keys):
    args = ["task=a", "task.max_steps=20", "task.log_every=1", *TWO, *extra]
    ddp = _ok(expgpu(args, tmp_path / "ddp"))
    fsdp_run = _ok(expgpu([*args, "launch.wrap=fsdp"], tmp_path / "fsdp"))
    _close(fsdp_run, ddp, keys)
    if "grad_norm" in keys:   # the clip acted: the norm it measured was over the limit
        assert max(r["grad_norm"] for r in fsdp_run.metrics()) > 0.05
    run_dir = tmp_path / "fsdp"
    assert (run_dir / "checkpoint" / ".metadata").exists() and not (run_dir / "checkpoint.pt").exists()


@pytest.mark.slow
def test_each_rank_holds_half_the_parameter_and_optimizer_bytes(tmp_path):
    held = {}
    for wrap in ("ddp", "fsdp"):
        _ok(probe(["task=probe_fsdp_memory", f"launch.wrap={wrap}", *TWO], tmp_path / wrap))
        held[wrap] = [json.loads((tmp_path / wrap / f"bytes{r}.json").read_text()) for r in (0, 1)]
    for rank in (0, 1):
        for kind in ("params", "optimizer"):
            ratio = held["fsdp"][rank][kind] / held["ddp"][rank][kind]
            assert 0.45 <= ratio <= 0.55, (rank, kind, held)


# Long enough that the stop (within max(2 steps, 1 s) of the signal, sent after the first row at
# step 5: by about step 55 here at ~50 steps/s, at step ~25 in practice) lands mid-run with a wide
# margin, and that the resumed run goes through an async periodic save (every 100 steps) before its end.
STEPS = 200
RESUME = ["task=a", f"task.max_steps={STEPS}", "task.log_every=5", "launch.wrap=fsdp", *TWO,
          "checkpoint.every_steps=100", "checkpoint.async_save=true"]


@pytest.mark.slow
def test_a_stopped_fsdp_run_resumes_bitwise(tmp_path):
    ref = _ok(expgpu(RESUME, tmp_path / "ref"))
    run_dir = tmp_path / "run"
    proc = start(RESUME, run_dir)
    wait_for_progress(proc, run_dir)
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, run_dir)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    stopped_at = stopped.result["steps"]
    assert 0 < stopped_at < STEPS
    shards = sorted(p.name for p in (run_dir / "checkpoint").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "expgpu.pt"], shards   # each rank wrote its own
    resumed = _ok(expgpu(RESUME, run_dir))
    assert resumed.result["resumed_from_step"] == stopped_at
    assert resumed.result["param_checksum"] == ref.result["param_checksum"]
    assert {s: r["loss"] for s, r in _rows(resumed).items()} == {s: r["loss"] for s, r in _rows(ref).items()}


TWO_MODELS = ["task=probe_fsdp_two_models", *TWO]


@pytest.fixture(scope="module")
def two_models_fsdp(tmp_path_factory):
    """The uninterrupted fsdp run of probe_fsdp_two_models (30 steps) and one that ended at step 15,
    computed once: a test resumes a copy of the latter's run dir."""
    root = tmp_path_factory.mktemp("two_models")
    whole = _ok(probe([*TWO_MODELS, "launch.wrap=fsdp", "task.max_steps=30"], root / "whole"))
    _ok(probe([*TWO_MODELS, "launch.wrap=fsdp", "task.max_steps=15"], root / "at15"))
    return whole, root / "at15"


@pytest.mark.slow
@pytest.mark.xdist_group("test_fsdp")
def test_two_models_and_two_optimizers_train_on_from_their_checkpoint_exactly(tmp_path, two_models_fsdp):
    whole, at15 = two_models_fsdp
    shutil.copytree(at15, tmp_path / "run")
    on = _ok(probe([*TWO_MODELS, "launch.wrap=fsdp", "task.max_steps=30"], tmp_path / "run"))
    assert on.result["resumed_from_step"] == 15
    assert on.result["param_checksum"] == whole.result["param_checksum"]
    assert on.result["metrics"] == whole.result["metrics"]


@pytest.mark.slow
@pytest.mark.xdist_group("test_fsdp")
def test_an_fsdp_checkpoint_resumes_under_ddp(tmp_path, two_models_fsdp):
    whole, at15 = two_models_fsdp
    shutil.copytree(at15, tmp_path / "run")
    on = _ok(probe([*TWO_MODELS, "launch.wrap=ddp", "task.max_steps=30"], tmp_path / "run"))
    assert on.result["resumed_from_step"] == 15
    assert math.isclose(on.result["metrics"]["loss_g"], whole.result["metrics"]["loss_g"], rel_tol=1e-4)
    # the single-file checkpoint ddp writes replaces the sharded one: one checkpoint in the run dir
    assert (tmp_path / "run" / "checkpoint.pt").exists() and not (tmp_path / "run" / "checkpoint").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("test_fsdp")
def test_resuming_a_checkpoint_that_cannot_load_is_one_line(tmp_path, two_models_fsdp):
    args = [*TWO_MODELS, "task.max_steps=5"]
    _ok(probe([*args, "launch.wrap=ddp"], tmp_path / "ddp"))
    line = error_line(probe([*args, "launch.wrap=fsdp", "task.max_steps=10"], tmp_path / "ddp"))
    assert "holds rank 0's whole model (checkpoint.format=pt" in line and "resume it unsharded" in line

    _, at15 = two_models_fsdp   # an fsdp run's sharded checkpoint (its step 15)
    shutil.copytree(at15, tmp_path / "fsdp")
    narrow = clean_env(PYTHONPATH=str(HELPERS), PROBE_WIDTH="8")
    line = error_line(probe([*args, "launch.wrap=fsdp", "task.max_steps=30"], tmp_path / "fsdp", env=narrow))
    assert "gen.0.weight has shape [16, 16] there, [8, 8] in this run's gen" in line, line

    shutil.copytree(at15, tmp_path / "torn")
    (tmp_path / "torn" / "checkpoint" / "__1_0.distcp").unlink()
    line = error_line(probe([*args, "launch.wrap=fsdp", "task.max_steps=30"], tmp_path / "torn"))
    assert f"checkpoint {tmp_path / 'torn' / 'checkpoint'} is incomplete: the shard __1_0.distcp is missing" in line


@pytest.mark.slow
def test_a_unit_class_the_model_lacks_stops_the_run_with_one_line(tmp_path):
    line = error_line(expgpu(["task=a", "launch.wrap=fsdp", "launch.fsdp.units=[Block]", *TWO], tmp_path / "run"))
    assert line == ("expgpu: error: launch.fsdp.units=['Block']: the model has no Block; its module classes are "
                    "Linear, MLP, ReLU")


@pytest.mark.slow
def test_an_async_save_is_in_place_once_written_and_resumes_bitwise_after_a_crash(tmp_path):
    """The save of step 25 is written in the background while training changes the parameters;
    a rank crashes at step 40, before any other save: the run resumes from step 25 and ends as an
    uninterrupted run does."""
    args = ["task=a", "task.max_steps=60", "task.log_every=5", "launch.wrap=fsdp", *TWO,
            "checkpoint.every_steps=25", "checkpoint.async_save=true"]
    ref = _ok(expgpu(args, tmp_path / "ref"))
    crashed = expgpu([*args, "faults.crash_rank=1", "faults.crash_step=40"], tmp_path / "run")
    assert crashed.returncode != 0 and "injected crash" in crashed.stderr
    resumed = _ok(expgpu(args, tmp_path / "run"))
    assert resumed.result["resumed_from_step"] == 25
    assert resumed.result["param_checksum"] == ref.result["param_checksum"]


@pytest.mark.slow
def test_a_ddp_run_saved_with_checkpoint_format_dcp_resumes_under_fsdp(tmp_path):
    args = ["task=probe_fsdp_two_models", *TWO]
    _ok(probe([*args, "launch.wrap=ddp", "checkpoint.format=dcp", "task.max_steps=15"], tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
    on = _ok(probe([*args, "launch.wrap=fsdp", "task.max_steps=30"], tmp_path / "run"))
    assert on.result["resumed_from_step"] == 15


@pytest.mark.slow
def test_the_lm_example_trains_with_fsdp_on_two_ranks(tmp_path):
    from conftest import REPO

    run = expgpu(["--config-dir", str(REPO / "examples" / "conf"), "experiment=charlm_fsdp", "task.max_steps=20",
                  "task.eval_every=10", "task.eval_batches=2", "checkpoint.every_steps=10"], tmp_path / "run",
                 env=clean_env(PYTHONPATH=str(REPO / "examples")))
    _ok(run)
    assert run.result["world_size"] == 2 and math.isfinite(run.result["metrics"]["val_loss"])
    assert (tmp_path / "run" / "checkpoint" / "__1_0.distcp").exists()


@pytest.mark.slow
def test_bf16_cpu_offload_and_gathered_units_train_and_resume(tmp_path):
    """The launch.fsdp options and task.precision=bf16 (bf16 compute, float32 shards and reductions)."""
    args = ["task=a", "task.log_every=5", "launch.wrap=fsdp", *TWO, "task.precision=bf16",
            "launch.fsdp.cpu_offload=true", "launch.fsdp.reshard_after_forward=false"]
    first = _ok(expgpu([*args, "task.max_steps=20"], tmp_path / "run"))
    rows = first.metrics()
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    on = _ok(expgpu([*args, "task.max_steps=30"], tmp_path / "run"))
    assert on.result["resumed_from_step"] == 20


@pytest.mark.slow
def test_a_task_that_shards_its_model_itself_checkpoints_every_ranks_shards_and_resumes_exactly(tmp_path):
    # launch.wrap=ddp (the default) and fully_shard in the task: checkpoint.format=auto saves the shards of
    # every rank (checkpoint.pt would keep rank 0's only, and its resume was refused as a sharded model's)
    args = ["task=probe_fsdp_shards_itself", *TWO]
    run = probe([*args, "checkpoint.verify=true", "task.log_every=1"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "verify.json").read_text())["exact"] is True
    assert (tmp_path / "run" / "verify" / "resumed" / "checkpoint").is_dir()
    assert not (tmp_path / "run" / "verify" / "resumed" / "checkpoint.pt").exists()
    line = error_line(probe([*args, "checkpoint.format=pt"], tmp_path / "pt"))
    assert "checkpoint.format=pt: run.track(model=...) is sharded (its parameters are DTensors" in line, line
    line = error_line(probe([*args, "+task.wrap_too=true"], tmp_path / "wrapped"))
    assert "run.wrap: the module is sharded already (fully_shard made it a FSDPSequential); leave run.wrap out" \
        in line, line
