"""The built-in loop's settings (precision, scheduler, accumulate, clip_grad_norm, eval_every,
eval_batch_size, compile), each checked by an outcome a user would notice, through the real CLI."""

from __future__ import annotations

import math
import signal

import pytest
import torch

from conftest import HELPERS, Run, clean_env, expgpu, finish, start, wait_for_progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SGD_A = ["task=a", "task.optimizer._target_=torch.optim.SGD", "task.optimizer.lr=0.1"]
STEP_LR = "task.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:5,gamma:0.5}"


def _params(run_dir) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["tracked"]["model"]


def _close(a: dict, b: dict, tol: float = 1e-5) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=tol, atol=tol) for k in a)


def test_eval_every_reports_the_loss_and_accuracy_of_the_whole_eval_set(tmp_path):
    run = expgpu(["task=b", "task.max_steps=20", "task.eval_every=10", "launch.nproc_per_node=2"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["step"]: r for r in run.metrics()}
    assert "eval_loss" in rows[10] and "accuracy" in rows[10] and "eval_loss" in rows[20]
    # what each rank evaluated on its half, all-reduced = the whole set, evaluated here at once
    from expgpu.tasks.data import NoisyWaves
    from expgpu.tasks.models import WaveCNN

    model = WaveCNN(classes=4)
    model.load_state_dict(_params(tmp_path / "run"))
    data = NoisyWaves(size=1024, classes=4, split_seed=1)
    with torch.no_grad():
        out = model(data.inputs)
    m = run.result["metrics"]
    assert math.isclose(m["eval_loss"], float(torch.nn.functional.cross_entropy(out, data.targets)), rel_tol=1e-5)
    assert m["accuracy"] == float((out.argmax(1) == data.targets).float().mean())
    assert m["eval_loss"] == rows[20]["eval_loss"]


def test_eval_batch_size_sets_the_evaluations_batches_and_not_its_result(tmp_path):
    """digits' 359 test examples on 2 ranks (180 and 179 each): batches of task.batch_size (32) unless
    task.eval_batch_size says otherwise; the same trained model gets the same accuracy either way."""
    runs = {}
    for name, extra in (("default", []), ("100", ["task.eval_batch_size=100"])):
        sizes = tmp_path / f"sizes-{name}"
        sizes.mkdir()
        env = clean_env(PYTHONPATH=str(HELPERS), EVAL_SIZES_DIR=str(sizes))
        runs[name] = expgpu(["task=digits", "task.max_steps=20", "launch.nproc_per_node=2",
                             "task.model._target_=eval_probe.EvalSizes", *extra], tmp_path / name, env=env)
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
        runs[name].sizes = [[int(n) for n in (sizes / f"rank{r}.txt").read_text().split()] for r in (0, 1)]
    assert runs["default"].sizes == [[32] * 5 + [20], [32] * 5 + [19]]
    assert runs["100"].sizes == [[100, 80], [100, 79]]
    default, bigger = runs["default"].result["metrics"], runs["100"].result["metrics"]
    assert default["accuracy"] == bigger["accuracy"] and default["final_loss"] == bigger["final_loss"]
    assert math.isclose(default["eval_loss"], bigger["eval_loss"], rel_tol=1e-6)


@pytest.fixture(scope="module")
def eager_a(tmp_path_factory) -> Run:
    """task=a for 20 steps on one rank, eagerly: computed once, for the two tests that read it."""
    return expgpu(["task=a", "task.max_steps=20"], tmp_path_factory.mktemp("eager") / "run")


@pytest.mark.xdist_group("test_supervised")
def test_regression_reports_no_accuracy(eager_a):
    run = eager_a
    assert run.returncode == 0, run.stderr
    assert set(run.result["metrics"]) == {"final_loss"}


def test_accumulating_two_micro_batches_of_16_is_one_batch_of_32(tmp_path):
    two = ["launch.nproc_per_node=2", "task.max_steps=5", "checkpoint.resume=false"]
    acc = expgpu(SGD_A + two + ["task.batch_size=16", "task.accumulate=2"], tmp_path / "acc")
    big = expgpu(SGD_A + two + ["task.batch_size=32"], tmp_path / "big")
    small = expgpu(SGD_A + two + ["task.batch_size=16"], tmp_path / "small")
    for run in (acc, big, small):
        assert run.returncode == 0, run.stderr[-3000:]
    assert acc.result["rank_checksums"][0] == acc.result["rank_checksums"][1]   # DDP synced the last micro-batch
    assert _close(_params(tmp_path / "acc"), _params(tmp_path / "big"))
    assert not _close(_params(tmp_path / "small"), _params(tmp_path / "big"))    # (the check has teeth)


def test_scheduler_steps_once_per_optimizer_step(tmp_path):
    run = expgpu(["task=a", "task.max_steps=20", "task.log_every=5", STEP_LR], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert [r["lr"] for r in run.metrics()] == [1e-3, 5e-4, 2.5e-4, 1.25e-4]   # the lr each step used


def test_clip_grad_norm_bounds_every_update(tmp_path):
    from expgpu.tasks.models import MLP

    run = expgpu(SGD_A + ["task.max_steps=10", "task.clip_grad_norm=0.01", "task.log_every=1"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert all(r["grad_norm"] > 0.01 for r in run.metrics())   # the norm before clipping is logged
    torch.manual_seed(0)   # the run's seed: the same initial weights
    start_params = MLP(32, 4, hidden=128).state_dict()
    moved = math.sqrt(sum(float((_params(tmp_path / "run")[k] - v).pow(2).sum()) for k, v in start_params.items()))
    assert moved <= 10 * 0.1 * 0.01 * 1.0001, moved   # steps x lr x max norm


@pytest.mark.parametrize("precision", ["bf16", "16"])
def test_reduced_precision_trains_on_two_ranks(tmp_path, precision):
    run = expgpu(["task=b", "task.max_steps=30", f"task.precision={precision}", "launch.nproc_per_node=2"],
                 tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [r["loss"] for r in run.metrics()]
    assert losses[-1] < losses[0] and len(set(run.result["rank_checksums"])) == 1
    tracked = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["tracked"]
    assert ("scaler" in tracked) == (precision == "16")   # fp16 scales its loss; the scale is resumed


def test_every_setting_resumes_exactly_after_a_stop(tmp_path):
    """fp16 + GradScaler, a scheduler, accumulation and clipping on 2 ranks: SIGTERM, rerun,
    and the parameters are those of the run that was never stopped."""
    # 300 steps: the stop lands within max(2 steps, 1 s) of the signal sent after the first row
    # (step 5), by about step 140 here (~130 steps/s); StepLR still halves the lr twice in the run
    args = ["task=a", "task.max_steps=300", "task.log_every=5", "task.precision=16", STEP_LR.replace("5,", "100,"),
            "task.accumulate=2", "task.clip_grad_norm=1.0", "launch.nproc_per_node=2"]
    straight = expgpu(args, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    proc = start(args, tmp_path / "run")
    wait_for_progress(proc, tmp_path / "run")
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, tmp_path / "run")
    at = stopped.result["steps"]   # read now: the rerun writes its own result.json
    assert stopped.returncode == 143 and 0 < at < 300, stopped.stderr[-3000:]
    resumed = expgpu(args, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == at
    assert resumed.result["param_checksum"] == straight.result["param_checksum"]


def test_the_loops_data_workers_start_once_a_run_not_once_an_epoch_and_resume_exactly(tmp_path):
    """data.num_workers=2 on 2 ranks, 4 batches an epoch on each: 12 steps are 3 epochs and 3 evaluations
    (eval_every=4), yet each rank's training loader started its 2 workers once, and so did its
    evaluation's (PyTorch's default would start 6 of each); stopped half-way and resumed
    (checkpoint.verify), the run trains as one never stopped."""
    pids = tmp_path / "pids"
    args = ["task=a", "task.max_steps=12", "task.batch_size=32", "data.num_workers=2", "launch.nproc_per_node=2",
            "task.dataset._target_=worker_probe.WorkerPids", "task.dataset.size=256", "task.eval_every=4",
            "task.log_every=1",
            f"+task.dataset.log_dir={pids / 'train'}",
            f"+task.eval_dataset={{_target_:worker_probe.WorkerPids,size:128,log_dir:{pids / 'eval'}}}"]
    env = clean_env(PYTHONPATH=str(HELPERS))
    run = expgpu(args, tmp_path / "run", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.metrics() if "eval_loss" in r] == [4, 8, 12]
    for loader in ("train", "eval"):
        started = {r: (pids / loader / f"rank{r}.txt").read_text().split() for r in (0, 1)}
        assert {r: len(set(p)) for r, p in started.items()} == {0: 2, 1: 2}, (loader, started)
    checked = expgpu([*args, "checkpoint.verify=true"], tmp_path / "verify", env=env)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "checkpoint.verify: exact: stopped at step 6 of 12 and resumed" in checked.stdout + checked.stderr


@pytest.mark.xdist_group("test_supervised")
def test_compile_trains_as_eager_does_and_resumes(tmp_path, eager_a):
    eager = eager_a
    compiled = expgpu(["task=a", "task.max_steps=20", "task.compile=true"], tmp_path / "compiled", timeout=300)
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-3000:]
    assert math.isclose(compiled.result["metrics"]["final_loss"], eager.result["metrics"]["final_loss"], rel_tol=1e-4)
    assert _close(_params(tmp_path / "compiled"), _params(eager.run_dir), 1e-4)   # no _orig_mod. prefix
    # the compiled run's own checkpoint loads into a compiled model again, and it trains on
    on = expgpu(["task=a", "task.max_steps=25", "task.compile=true"], tmp_path / "compiled", timeout=300)
    assert on.returncode == 0, on.stderr[-3000:]
    assert on.result["resumed_from_step"] == 20 and on.result["steps"] == 25


@pytest.mark.parametrize("args,says", [
    (["task.accumulate=0"], "task.accumulate=0 is not allowed: an integer >= 1"),
    (["task.clip_grad_norm=-1"], "task.clip_grad_norm=-1.0 is not allowed: null or a max norm > 0"),
    (["task.eval_every=-5"], "task.eval_every=-5 is not allowed"),
    (["task.precision=fp8"], "task.precision='fp8' is not allowed: 32, 16 or bf16"),
    (["task.scheduler={_target_:torch.optim.lr_scheduler.StepLR,step_size:5}"],
     "task.scheduler: cannot build torch.optim.lr_scheduler.StepLR"),
    (["task.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_sise:5}"],
     "task.scheduler.step_sise: torch.optim.lr_scheduler.StepLR takes no parameter 'step_sise' (did you mean "
     "task.scheduler.step_size?); it takes optimizer, step_size, gamma, last_epoch"),
    # a value the constructor checks (torch's ValueError)
    (["task.optimizer.lr=-1"], "task.optimizer: Adam refused its settings (ValueError: Invalid learning rate: -1)"),
    (["task.scheduler={_target_:torch.optim.lr_scheduler.CosineAnnealingWarmRestarts,_partial_:true,T_0:0}"],
     "task.scheduler: CosineAnnealingWarmRestarts refused its settings (ValueError: Expected positive integer T_0"),
    (["task.loss=hinge"], "task.loss='hinge' is not allowed: mse, cross_entropy or {_target_: ...}"),
    (["task.eval_batch_size=0"], "task.eval_batch_size=0 is not allowed: null (task.batch_size) or an integer >= 1"),
    (["launch.wrap=none", "launch.nproc_per_node=2"],
     "launch.wrap=none on 2 ranks: the built-in loop would train 2 separate models, each on its share of the data"),
    # settings the constructor takes and the first step (or a later one) refuses
    (["task.scheduler={_target_:torch.optim.lr_scheduler.OneCycleLR,_partial_:true,max_lr:0.01,total_steps:3}"],
     "task.scheduler: OneCycleLR failed at step 4 (ValueError: Tried to step 4 times. The specified number of total "
     "steps is 3); the built-in loop steps it once a step, with no argument, for task.max_steps=5 steps"),
    (["task.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:0}"],
     "task.scheduler: StepLR failed at step 1 (ZeroDivisionError: integer modulo by zero)"),
    (["task.scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true}"],
     "task.scheduler: ReduceLROnPlateau failed at step 1 (TypeError: "),
])
def test_bad_loop_settings_are_one_line_and_exit_2(tmp_path, args, says):
    run = expgpu(["task=a", "task.max_steps=5", *args], tmp_path / "run")
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: error:") and says in last, last
    assert "Traceback" not in run.stderr
