"""The Run API end to end: task functions of one's own, through the real CLI and real processes.

Probe functions (tests/helpers/run_probe.py, tests/conf/task/probe_*.yaml) check one behaviour each; the
three examples in examples/ (a GAN, a character LM, a digits classifier) are the users' code that
must run on 1 and 2 ranks and resume exactly after a stop.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from probes import PROBE_ENV, error_line, probe

from conftest import HELPERS, REPO, Run, clean_env, expgpu, finish, logged, start, untimed, wait_for_progress
from expgpu.errors import UserError

pytestmark = pytest.mark.timeout(240)

EXAMPLES_ENV = clean_env(PYTHONPATH=str(REPO / "examples"))


def example(args: list[str], run_dir: Path, **kw) -> Run:
    return expgpu(["--config-dir", str(REPO / "examples" / "conf"), *args], run_dir, env=EXAMPLES_ENV, **kw)


# -- parameters --------------------------------------------------------------------------------

@pytest.mark.slow
def test_parameters_are_converted_to_the_functions_annotations(tmp_path):
    # task.steps and task.flag are not in the task file: the function's defaults are
    run = probe(["task=probe_typed", "task.steps=3", "task.flag=true"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    m = run.result["metrics"]
    assert m == {"lr": 0.002, "steps": 3, "flag": True, "lr_type_float": 1}   # `lr: 2e-3` in YAML is a float
    assert run.result["function"] == "run_probe.typed" and run.result["task"] == "probe_typed"


@pytest.mark.slow
def test_lists_tuples_dicts_and_choices_are_converted_element_by_element(tmp_path):
    run = probe(["task=probe_containers", "task.layers=[64,32]", "task.betas=[1,0.5]", "+task.sizes={a:1,b:2}",
                 "task.mode=b", "task.opt=SGD"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "run" / "params.json").read_text())
    assert got == {"layers": [64, 32], "betas": [1.0, 0.5], "sizes": {"a": 1, "b": 2}, "mode": "b", "opt": "sgd",
                   "types": ["list", "tuple", "float", "dict", "int"]}


@pytest.mark.parametrize("args,says", [
    (["task.layers=[a,b]"], "task.layers[0]='a' is not allowed: an integer"),
    (["task.layers=5"], "task.layers=5 is not allowed: a list ([...])"),
    (["task.betas=[1,2,3]"], "task.betas=[1, 2, 3] is not allowed: a list of 2 values"),
    (["+task.sizes={a:x}"], "task.sizes.a='x' is not allowed: an integer"),
    (["task.mode=c"], "task.mode='c' is not allowed: one of a, b"),
    (["task.opt=lbfgs"], "task.opt='lbfgs' is not allowed: one of ADAM, SGD"),
])
@pytest.mark.slow
def test_bad_container_and_choice_values_are_one_line_and_exit_2(tmp_path, args, says):
    assert says in error_line(probe(["task=probe_containers", *args], tmp_path / "run"))


@pytest.mark.parametrize("args,says", [
    (["task.lr_x=0.1"], "task.lr_x: run_probe.typed takes no parameter 'lr_x' (did you mean task.lr?); it takes "
                         "lr, steps, flag, label"),
    (["task.steps=abc"], "task.steps='abc' is not allowed: an integer"),
    (["~task.lr"], "task.lr: run_probe.typed needs it (a parameter without a default)"),
    (["task._target_=run_probe.nope"], "task._target_=run_probe.nope: run_probe has no attribute 'nope'"),
    (["task._target_=no_such_pkg.train"], "task._target_=no_such_pkg.train: no module named 'no_such_pkg'"),
    (["task._target_=broken_probe.train"], "importing broken_probe.train failed: ModuleNotFoundError: "
                                           "No module named 'a_dependency_not_installed'"),
    (["task._target_=run_probe.json"], "task._target_=run_probe.json: a module, not a function"),
    (["task.precision=8"], "task.precision=8 is not allowed: 32, 16 or bf16"),
    (["task.log_reduce=median"], "task.log_reduce='median' is not allowed: last or mean"),
])
@pytest.mark.slow
def test_bad_task_parameters_are_one_line_and_exit_2(tmp_path, args, says):
    assert says in error_line(probe(["task=probe_typed", *args], tmp_path / "run"))


@pytest.mark.slow
def test_log_reduce_is_the_runs_key_for_the_built_in_loop_too(tmp_path):
    bad = expgpu(["task=a", "task.log_reduce=max"], tmp_path / "bad")
    assert "task.log_reduce='max' is not allowed: last or mean" in error_line(bad)
    run = expgpu(["task=a", "task.max_steps=10", "task.log_every=5", "task.log_reduce=mean"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.metrics()] == [5, 10]


@pytest.mark.parametrize("task,args,says", [
    ("probe_track_no_state", [], "run.track(thing=...): a object has no state_dict() and load_state_dict()"),
    ("probe_track_a_name_twice", [], "run.track(model=...): 'model' tracks a Linear already; give the SGD a name of "
                                     "its own"),
    ("probe_returns", [], "run_probe.returns returned a list; return a dict of numbers"),
    ("probe_log_vector", [], "run.log(v=...): a tensor of shape (3,); log numbers or one-element tensors"),
    ("probe_returns", ["task.kind=dict"], "run_probe.returns returned name='text'; metrics are numbers"),
    ("probe_log_epoch", ["launch.nproc_per_node=2"],
     "run.log(epoch=...): step, epoch and time are written with every row by expgpu; log it under another name"),
    ("probe_reduces", ["task.op=avg"], "run.all_reduce(op='avg') is not allowed: sum, mean, max, min"),
    ("probe_gathers", ["task.bad=shape", "launch.nproc_per_node=2"],
     "run.gather: value['scores'] is a torch.float32 tensor of shape [4, 2] on rank 1, a torch.float32 one of shape "
     "[5, 1] on rank 0; every rank's must have the same dtype and shape but for the first dimension"),
    ("probe_gathers", ["task.bad=src"], "run.broadcast(src=5): the rank whose object every rank gets, 0 to 0"),
    ("probe_reduces", ["task.extra_on=1", "launch.nproc_per_node=2"],
     "run.all_reduce: rank 1 reduces the keys array, extra, float, ints, number, numpy, tensor, rank 0 array, float, "
     "ints, number, numpy, tensor; every rank must give the same keys"),
])
@pytest.mark.slow
def test_misuse_of_the_api_is_one_line_and_exit_2(tmp_path, task, args, says):
    assert says in error_line(probe([f"task={task}", *args], tmp_path / "run"))


@pytest.mark.slow
def test_a_function_that_raises_on_one_rank_ends_the_group_naming_it(tmp_path):
    run = probe(["task=probe_raises", "launch.nproc_per_node=2", "backend.timeout_s=30"], tmp_path / "run")
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == \
        "expgpu: rank 1 failed: ValueError: probe failure on rank 1 at step 3", run.stderr[-3000:]


@pytest.mark.slow
def test_a_checkpoint_that_tracks_other_names_is_refused(tmp_path):
    first = probe(["task=probe_tracks"], tmp_path / "run", env={**PROBE_ENV, "PROBE_TRACK": "model"})
    assert first.returncode == 0, first.stderr
    again = probe(["task=probe_tracks", "task.max_steps=8"], tmp_path / "run", env={**PROBE_ENV, "PROBE_TRACK": "net"})
    assert "checkpoint.pt tracks model, this run tracks net (run.track)" in error_line(again)


@pytest.mark.slow
def test_ranks_that_end_out_of_step_are_named_as_the_checkpoint_keeps_rank_0s(tmp_path):
    apart = probe(["task=probe_tracks", "launch.nproc_per_node=2", "launch.wrap=none"], tmp_path / "none")
    assert apart.returncode == 0, apart.stderr[-3000:]
    assert len(set(apart.result["rank_checksums"])) == 2   # each rank's own initialization, never synced
    assert "rank(s) 1 ended with other parameters than rank 0 (result.json's rank_checksums): launch.wrap=none " \
           "keeps no rank in step, and the checkpoint keeps rank 0's state" in apart.output
    synced = probe(["task=probe_tracks", "launch.nproc_per_node=2"], tmp_path / "ddp")   # DDP: rank 0's at the start
    assert synced.returncode == 0 and len(set(synced.result["rank_checksums"])) == 1
    assert "ended with other parameters" not in synced.output


@pytest.mark.slow
def test_a_model_not_given_to_run_wrap_on_two_ranks_is_said_before_the_first_step_and_at_the_end(tmp_path):
    run = probe(["task=probe_unwrapped", "launch.nproc_per_node=2"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("run.wrap was not called: on 2 ranks each trains its own copy of model, with no gradient sync "
            "(launch.wrap=ddp wraps what run.wrap is given), and the checkpoint keeps rank 0's: model = "
            "run.wrap(model) before the loop") in run.output
    assert ("rank(s) 1 ended with other parameters than rank 0 (result.json's rank_checksums): no gradient sync kept "
            "them in step (launch.wrap=ddp syncs a module given to run.wrap, in the steps whose loss comes from its "
            "forward, model(...))") in run.output
    alone = probe(["task=probe_unwrapped", "launch.nproc_per_node=2", "launch.wrap=none"], tmp_path / "alone")
    assert alone.returncode == 0 and "run.wrap was not called" not in alone.output   # each rank alone, as asked
    assert "launch.wrap=none keeps no rank in step" in alone.output


@pytest.mark.slow
def test_parameters_a_step_leaves_out_are_named_and_ddps_option_for_them_reaches_ddp(tmp_path):
    """Each rank's loss leaves one head out: DDP's error, at the next forward, would list indices and advise a DDP
    keyword run.wrap did not take; now one line names them, and the option (code or config) lets it train."""
    base = ["task=probe_two_heads", "launch.nproc_per_node=2"]
    failed = probe(base, tmp_path / "failed")
    assert failed.returncode == 2, failed.stderr[-3000:]
    last = failed.output.strip().splitlines()[-1]
    assert last.startswith("expgpu: error: run.wrap(TwoHeads): on rank ") and "Traceback" not in failed.output
    assert re.search(r"gave head_[ab].weight, head_[ab].bias no gradient \(not used in its loss\)", last), last
    assert "run.wrap(model, find_unused_parameters=True) or launch.ddp.find_unused_parameters=true" in last
    for how, overrides in (("code", ["task.find_unused=true"]), ("config", ["launch.ddp.find_unused_parameters=true"])):
        run = probe(base + overrides, tmp_path / how)
        assert run.returncode == 0, (how, run.stderr[-3000:])
        assert run.result["metrics"]["find_unused"] == 1 and run.result["steps"] == 6
    # the call's own keyword wins over launch.ddp's for its module
    over = probe(base + ["task.find_unused=false", "launch.ddp.find_unused_parameters=true"], tmp_path / "over")
    assert over.returncode == 2 and "gave head_" in over.output


@pytest.mark.slow
def test_a_loss_computed_by_a_method_of_the_module_around_ddp_is_said_after_the_first_step(tmp_path):
    run = probe(["task=probe_around_ddp", "launch.nproc_per_node=2"], tmp_path / "method")
    assert run.returncode == 0, run.stderr[-3000:]
    said = [ln for ln in run.output.splitlines() if "no forward through DDP" in ln]
    assert len(said) == 1 and "[rank 0]" in said[0], said   # once, by rank 0
    assert "model.loss(...) (a method of TwoHeads, called on what run.wrap returned) runs your module directly" \
        in said[0]
    assert "rank(s) 1 ended with other parameters than rank 0" in run.output
    through = probe(["task=probe_around_ddp", "launch.nproc_per_node=2", "task.how=forward"], tmp_path / "forward")
    assert through.returncode == 0 and "no forward through DDP" not in through.output
    assert "other parameters" not in through.output


@pytest.mark.slow
def test_a_loop_that_breaks_early_saves_the_steps_it_did(tmp_path):
    """A break after step 40's body: 40 steps done, the same checkpoint as max_steps=40, and a
    rerun with more steps trains on as the uninterrupted run does."""
    base = ["task=probe_breaks", "launch.nproc_per_node=2"]
    broke = probe(base + ["task.stop_at=40"], tmp_path / "broke")
    capped = probe(base + ["task.max_steps=40"], tmp_path / "capped")
    for run in (broke, capped):
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.result["steps"] == 40 and run.result["status"] == "finished"
    assert "checkpoint at step 40 (end of training)" in broke.output
    assert broke.result["param_checksum"] == capped.result["param_checksum"]
    assert broke.result["timing"]["train_s"] is not None
    on = [probe(base + ["task.stop_at=40", "task.max_steps=60"], tmp_path / "broke"),   # steps 40..59 never break
          probe(base + ["task.max_steps=60"], tmp_path / "capped")]
    straight = probe(base, tmp_path / "straight")
    for run in (*on, straight):
        assert run.returncode == 0, run.stderr[-3000:]
    assert on[0].result["resumed_from_step"] == on[1].result["resumed_from_step"] == 40
    assert on[0].result["param_checksum"] == on[1].result["param_checksum"] == straight.result["param_checksum"]


@pytest.mark.slow
def test_a_tracked_dict_is_restored_in_place(tmp_path):
    stopped = probe(["task=probe_keeps_best", "task.max_steps=12"], tmp_path / "run")   # best so far: step 10
    resumed = probe(["task=probe_keeps_best"], tmp_path / "run")                        # steps 12..19 are worse
    for run in (stopped, resumed):
        assert run.returncode == 0, run.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == 12
    assert resumed.result["metrics"] == {"loss": 0.5, "step": 10, "mean": 0.5}


@pytest.mark.slow
def test_tracked_state_a_resume_could_not_load_is_refused_before_training(tmp_path):
    line = error_line(probe(["task=probe_tracks_numpy", "launch.nproc_per_node=2"], tmp_path / "run"))
    assert line.startswith("expgpu: error: run.track(counts=...): its state_dict() holds what a resume cannot "
                           "load (Unsupported global: GLOBAL numpy"), line
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_checkpoint_holding_what_tensors_only_loading_refuses_says_so(tmp_path):
    import numpy as np

    from expgpu.checkpoint import file as checkpoint

    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, {"format": checkpoint.FORMAT, "tracked": {"counts": {"seen": np.zeros(2)}}})
    with pytest.raises(UserError) as e:
        checkpoint.load(path, {})
    assert "holds an object that torch.load(weights_only=True) does not read" in str(e.value)
    assert "a tracked object's state_dict() returned it" in str(e.value) and "corrupt" not in str(e.value)


def _reduced(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"reduced{rank}.json").read_text())


@pytest.mark.parametrize("op,want", [
    ("sum", {"tensor": [3.0, 6.0], "ints": [1, 20], "number": 3, "float": 1.5, "numpy": 3.0, "array": [1, 2]}),
    ("mean", {"tensor": [1.5, 3.0], "ints": [0.5, 10.0], "number": 1.5, "float": 0.75, "numpy": 1.5,
              "array": [0.5, 1.0]}),
    ("max", {"tensor": [2.0, 4.0], "ints": [1, 10], "number": 2, "float": 1.0, "numpy": 2.0, "array": [1, 1]}),
])
@pytest.mark.slow
def test_all_reduce_combines_every_ranks_values_and_barrier_waits(tmp_path, op, want):
    run = probe(["task=probe_reduces", "launch.nproc_per_node=2", f"task.op={op}"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [_reduced(tmp_path / "run", r) for r in (0, 1)]
    for got in ranks:
        assert got["out"] == want
        assert got["types"]["number"] == ("float" if op == "mean" else "int") and got["types"]["tensor"] == "Tensor"
        assert got["seen_ready"]            # rank 1 passed the barrier only after rank 0's write
    assert ranks[0]["mine_kept"] == 1 and ranks[1]["mine_kept"] == 2   # out of place
    assert ranks[1]["keys"] == list(reversed(ranks[0]["keys"]))        # each rank's own key order back
    assert run.result["metrics"]["total"] == {"sum": 3.0, "mean": 1.5, "max": 2.0}[op]


@pytest.mark.slow
def test_all_reduce_on_one_rank_is_the_value(tmp_path):
    run = probe(["task=probe_reduces", "task.op=mean"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert _reduced(tmp_path / "run", 0)["out"] == {"tensor": [1.0, 2.0], "ints": [0.0, 10.0], "number": 1.0,
                                                     "float": 0.5, "numpy": 1.0, "array": [0.0, 1.0]}


@pytest.mark.slow
def test_gather_brings_every_ranks_share_of_an_evaluation_once_and_broadcast_rank_0s_choice(tmp_path):
    run = probe(["task=probe_gathers", "launch.nproc_per_node=2"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    seen = [json.loads((tmp_path / "run" / f"gathered{r}.json").read_text()) for r in (0, 1)]
    assert [s["shares"] for s in seen] == [5, 4]              # 9 examples, each on one rank: unequal shares
    for s in seen:                                             # every rank has all of them, each once, paired
        assert sorted(s["ids"]) == list(range(9)) and len(s["ids"]) == 9
        assert s["scores"] == pytest.approx([2 * i / 9 for i in s["ids"]])
        assert s["zero_d"] == [0, 10] and s["numbers"] == [1, 2] and s["words"] == [["w0"], ["w1"]]
        assert s["choice"] == {"picked": "rank 0"}
    assert seen[0]["ids"] == seen[1]["ids"]                    # in rank order, the same on every rank
    assert run.result["metrics"]["examples"] == 9


# -- seeding and logging ---------------------------------------------------------------------

def _draws(run_dir: Path, rank: int):
    return json.loads((run_dir / f"draws{rank}.json").read_text())


@pytest.mark.slow
def test_ranks_draw_their_own_random_numbers_unless_seed_per_rank_is_false(tmp_path):
    own = probe(["task=probe_draws", "launch.nproc_per_node=2"], tmp_path / "own")
    same = probe(["task=probe_draws", "launch.nproc_per_node=2", "task.seed_per_rank=false"], tmp_path / "same")
    for run in (own, same):
        assert run.returncode == 0, run.stderr
        assert len(set(run.result["rank_checksums"])) == 1   # DDP broadcast rank 0's weights either way
    assert _draws(tmp_path / "own", 0) != _draws(tmp_path / "own", 1)      # dropout masks, torch.rand
    assert _draws(tmp_path / "same", 0) == _draws(tmp_path / "same", 1)


@pytest.mark.slow
def test_log_is_read_back_at_log_steps_and_keeps_odd_steps(tmp_path):
    run = probe(["task=probe_logs", "task.log_every=5"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    rows = [logged(r) for r in run.metrics()]
    # x is logged at every step (body of step s -> row s + 1): only the value at a log step is
    # written; ev, logged once at step 6, is written at its own step; `after` joins the last row
    assert rows == [{"step": 5, "x": 4.0}, {"step": 7, "ev": 1.5}, {"step": 10, "x": 9.0},
                    {"step": 12, "x": 11.0, "after": 7}], rows
    assert run.result["metrics"] == {"steps_seen": 12, "batches_none": 1, "first": 0}


@pytest.mark.slow
def test_log_reduce_mean_writes_each_windows_mean_and_odd_steps_as_logged(tmp_path):
    run = probe(["task=probe_logs", "task.log_every=5", "task.log_reduce=mean"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    rows = [logged(r) for r in run.metrics()]
    # x = the body's step, logged at step + 1: the rows hold means of 0..4, 5..9 and 10..11; ev,
    # logged once, and `after`, an int logged once after the loop, are written as they were logged
    assert rows == [{"step": 5, "x": 2.0}, {"step": 7, "ev": 1.5}, {"step": 10, "x": 7.0},
                    {"step": 12, "x": 10.5, "after": 7}], rows


def _window_means(max_steps: int, every: int) -> list[dict]:
    """What probe_logs_window's metrics.jsonl holds under log_reduce=mean: per window of `every`
    steps, x's mean at the window's last step, y's at the last step y was logged in it."""
    import torch

    rows: dict[int, dict] = {}
    for end in range(every, max_steps + 1, every):
        steps = range(end - every + 1, end + 1)   # rows count steps done: body k logs at k + 1
        xs = [(torch.tensor(s + 0.0) / 3).item() for s in steps]
        rows.setdefault(end, {})["x"] = sum(xs) / len(xs)
        ys = [s for s in steps if (s - 1) % 3 == 0]
        if ys:
            rows.setdefault(ys[-1], {})["y"] = sum((s - 1) / 4 for s in ys) / len(ys)
    return [{"step": s, **rows[s]} for s in sorted(rows)]


@pytest.mark.slow
def test_log_reduce_mean_stopped_mid_window_resumes_to_the_uninterrupted_rows(tmp_path):
    """2 ranks, gloo, through the CLI: a SIGTERM in the middle of a log_every window; the checkpoint
    holds each name's sum and count, so the resumed run writes the window's mean over all of it."""
    args = ["task=probe_logs_window", "launch.nproc_per_node=2", "task.log_every=5", "task.log_reduce=mean",
            "checkpoint.poll_every=1"]
    straight = probe(args, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = probe(args, tmp_path / "run", env=clean_env(PYTHONPATH=str(HELPERS), PROBE_STOP_AT="11"))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    at = stopped.result["steps"]
    # the ranks agree on the stop two polls after it reached rank 0 (body of step 11): step 13
    assert stopped.result["status"] == "stopped" and at % 5 != 0 and 11 < at < 30, stopped.result
    resumed = probe(args, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == at
    rows = [[logged(r) for r in run.metrics()]
            for run in (resumed, straight)]
    assert rows[0] == rows[1]   # bit for bit: the float32 sum went on from where it stopped
    want = _window_means(30, 5)
    assert len(rows[1]) == len(want) and all(r == pytest.approx(w) for r, w in zip(rows[1], want)), rows[1]


# -- users' code: the examples ---------------------------------------------------------------

SMALL = {
    "gan": ["task.max_steps=40", "task.log_every=10"],
    "charlm": ["task.max_steps=6", "task.eval_every=3", "task.eval_batches=2", "task.width=32", "task.block=16",
               "task.batch_size=8", "task.log_every=2"],
    "digits_f1": ["task.max_steps=60", "task.eval_every=30"],
}
RETURNS = {"gan": {"loss_d", "loss_g", "modes_covered", "high_quality"},
           "charlm": {"val_loss", "val_perplexity", "train_loss"},
           "digits_f1": {"accuracy", "macro_f1", "final_loss"}}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("task", ["gan", "charlm", "digits_f1"])
def test_example_trains_on_one_and_two_ranks_with_identical_parameters(tmp_path, task, nproc):
    run = example([f"task={task}", f"launch.nproc_per_node={nproc}", *SMALL[task]], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    res = run.result
    assert res["status"] == "finished" and res["world_size"] == nproc and res["function"] == f"my_tasks.{task}.train"
    assert set(res["metrics"]) == RETURNS[task]
    assert len(res["rank_checksums"]) == nproc and len(set(res["rank_checksums"])) == 1
    assert res["rank_checksums"][0] is not None


@pytest.mark.slow
def test_example_metrics_are_the_whole_test_sets(tmp_path):
    """digits_f1 all-reduces its confusion matrix: 2 ranks score all 359 test digits, not half."""
    run = example(["task=digits_f1", "launch.nproc_per_node=2", "task.max_steps=300"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["metrics"]["accuracy"] > 0.9 and run.result["metrics"]["macro_f1"] > 0.9


@pytest.mark.slow
def test_augmentation_in_dataloader_workers_resumes_exactly(tmp_path):
    """Noise drawn in the loader's workers is seeded per batch: a run stopped mid-epoch and rerun
    ends with the uninterrupted parameters, and the worker count does not change them."""
    base = ["task=probe_augments", "launch.nproc_per_node=2"]   # 16 steps an epoch, 40 steps
    straight = probe(base, tmp_path / "straight")
    one_worker = probe(base + ["task.workers=1"], tmp_path / "one_worker")
    in_process = probe(base + ["task.workers=0"], tmp_path / "in_process")
    stopped = probe(base + ["task.max_steps=7"], tmp_path / "run")
    resumed = probe(base, tmp_path / "run")
    for run in (straight, one_worker, in_process, stopped, resumed):
        assert run.returncode == 0, run.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == 7
    assert resumed.result["param_checksum"] == straight.result["param_checksum"]
    assert one_worker.result["param_checksum"] == straight.result["param_checksum"]
    assert straight.result["metrics"]["dataset_len"] == 512   # loader.dataset reads through
    # the noise counts: drawn from the main process's RNG instead, training ends elsewhere
    assert in_process.result["param_checksum"] != straight.result["param_checksum"]


# Lengths: the stop lands within max(2 steps, 1 s) of the signal, sent after the first row (step 20):
# here by about step 140 of gan (~120 steps/s) and step 350 of digits_f1 (~320 steps/s), at steps
# 40-60 in practice, so each run stops mid-training with a wide margin; digits_f1 still evaluates
# (step 500) after its resume.
@pytest.mark.parametrize("task,args", [
    ("gan", ["task.max_steps=600", "task.log_every=20"]),
    # dropout: the resumed run must draw the same masks (RNG restored, no draw by the loader)
    ("digits_f1", ["task.max_steps=900", "task.eval_every=500", "task.log_every=20"]),
])
@pytest.mark.slow
def test_example_stopped_and_rerun_ends_with_the_uninterrupted_parameters(tmp_path, task, args):
    args = [f"task={task}", "launch.nproc_per_node=2", *args]
    straight = example(args, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "run"
    proc = start(["--config-dir", str(REPO / "examples" / "conf"), *args], run_dir, env=EXAMPLES_ENV)
    wait_for_progress(proc, run_dir)
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, run_dir)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    at = stopped.result["steps"]
    assert stopped.result["status"] == "stopped" and 0 < at < straight.result["steps"], stopped.result
    resumed = example(args, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == at
    assert resumed.result["param_checksum"] == straight.result["param_checksum"]
    assert resumed.result["metrics"] == straight.result["metrics"]
    rows = [[untimed(r) for r in run.metrics()] for run in (resumed, straight)]
    assert rows[0] and rows[0] == rows[1]   # metrics.jsonl reads like the uninterrupted run's
