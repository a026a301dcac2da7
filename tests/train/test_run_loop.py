"""The Run API's loop in this process, on one rank (fast tier): steps and rows, a stop and its
checkpoint, an exact resume (run.steps and run.epochs), each rank's tracked dicts, and the calls
refused in one line. The same on 2 ranks, through the CLI, is tests/train/test_run_api.py."""

from __future__ import annotations

import json
import time

import pytest
import torch
from config_compose import composed

from conftest import untimed
from expgpu import config, task
from expgpu.errors import UserError
from expgpu.launch.worker import _call
from expgpu.procs import stop_signals
from expgpu.procs.stop_signals import NEVER
from expgpu.ranks import RankInfo
from expgpu.train.agreement import StopAgreement
from expgpu.train.run import Run

HERE = __name__
ONE = RankInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, master_addr="127.0.0.1",
               master_port=0, source="single")


@pytest.fixture(scope="module")
def base_cfg() -> dict:
    return config.plain(composed("logger=none"))


def run_task(run_dir, base_cfg, fn: str, stop_at: int | None = None, **keys) -> tuple[str, dict, Run]:
    """fn(run, **keys) as launch.worker calls it; `stop_at`: a stop requested on reaching that step."""
    run_dir.mkdir(parents=True, exist_ok=True)   # made by the CLI before any rank starts
    cfg = {**base_cfg, "task": {"_target_": f"{HERE}.{fn}", "_partial_": True, **keys}}
    spec = task.resolve(cfg["task"])
    # StopSignals not installed: this process's signals stay pytest's
    agreement = StopAgreement(stop_signals.StopSignals(), stop_at=stop_at if stop_at is not None else NEVER)
    run = Run(info=ONE, device=torch.device("cpu"), run_dir=run_dir, cfg=cfg, spec=spec, agreement=agreement)
    status, metrics = _call(run, spec)
    return status, metrics, run


def rows(run_dir) -> list[dict]:
    return [untimed(json.loads(line))
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Noisy(torch.utils.data.Dataset):
    """Targets with noise drawn when an item is read: a resume must draw what the first run drew."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        x = torch.full((4,), float(i) / 40)
        return x, x.sum(0, keepdim=True) + 0.1 * torch.randn(1)


def regress(run: Run, max_steps: int = 30, lr: float = 0.05):
    model = run.wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    best = {"loss": float("inf")}
    run.track(model=model, opt=opt, best=best)
    for step, (x, y) in run.steps(run.loader(Noisy(), batch_size=8), max_steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        best["loss"] = min(best["loss"], loss.item())
        run.log(loss=loss)
    return {"loss": loss.item(), "best": best["loss"]}


def by_epoch(run: Run, epochs: int = 3):
    model = run.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"epoch_loss": 0.0, "starts": 0}
    run.track(model=model, opt=opt, state=state)
    for epoch in run.epochs(epochs):
        state["epoch_loss"], state["starts"] = 0.0, state["starts"] + 1
        for step, (x, y) in run.steps(run.loader(Noisy(), batch_size=8)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["epoch_loss"] += loss.item()
        run.log(epoch_loss=state["epoch_loss"], starts=state["starts"])
    return {"epoch_loss": state["epoch_loss"]}


@pytest.mark.parametrize("fn, stop_at, steps", [("regress", 12, 30), ("by_epoch", 7, 15)], ids=["steps", "epochs"])
def test_a_stop_saves_and_the_rerun_ends_as_the_uninterrupted_run(tmp_path, base_cfg, fn, stop_at, steps):
    whole = run_task(tmp_path / "whole", base_cfg, fn)
    assert whole[0] == "finished" and whole[2].step == steps

    status, metrics, run = run_task(tmp_path / "stopped", base_cfg, fn, stop_at=stop_at)
    assert (status, metrics, run.step, run.stop_signal) == ("stopped", {}, stop_at, "SIGTERM")
    assert (tmp_path / "stopped" / "checkpoint.pt").exists()
    resumed = run_task(tmp_path / "stopped", base_cfg, fn)
    assert resumed[2].resumed_from_step == stop_at
    assert resumed[1] == whole[1] and resumed[2].checksums() == whole[2].checksums()
    assert rows(tmp_path / "stopped") == rows(tmp_path / "whole")


def prunes_itself(run: Run, at: int = 7):
    """A trial whose pruner says prune at step `at` (tune.bridge requests it on rank 0 as a row is written)."""
    model = run.wrap(torch.nn.Linear(1, 1))
    run.track(model=model)
    for step, _ in run.steps(None, 30):
        run.log(loss=float(step + 1))
        if step + 1 == at:
            run._agreement.signals.request(stop_signals.PRUNED)


class Slow(torch.utils.data.Dataset):
    """Each item takes 3 ms to read: the loop waits for its batches most of the time."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.ones(4), torch.ones(1)


def slow_data(run: Run, max_steps: int = 12, loader: bool = True):
    model = run.wrap(torch.nn.Linear(4, 1))
    for step, batch in run.steps(run.loader(Slow(), batch_size=4) if loader else None, max_steps):
        run.log(loss=model(torch.ones(1, 4)).sum())


def test_the_share_of_the_time_spent_waiting_for_batches_is_in_the_rows_and_result(tmp_path, base_cfg):
    status, _, run = run_task(tmp_path / "slow", base_cfg, "slow_data", log_every=4)
    share = run.timings(0.0)["data_wait"]
    assert status == "finished" and 0.5 < share <= 1.0   # 12 ms a batch against a step of a few microseconds
    got = [json.loads(line) for line in (tmp_path / "slow" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.5 < row["data_wait"] <= 1.0 for row in got), got
    assert run.data_workers() == (0, False)
    # no loader: nothing waited for, and no such field
    status, _, run = run_task(tmp_path / "none", base_cfg, "slow_data", loader=False, log_every=4)
    assert run.timings(0.0)["data_wait"] is None and run.data_workers() == (None, False)
    assert not any("data_wait" in json.loads(line) for line in (tmp_path / "none" / "metrics.jsonl").open())


def evaluates(run: Run, epochs: int = 3, how: str = "forgot"):
    """An evaluation at each epoch's end (model.eval()); how=forgot: no model.train() after it; right: train()
    at each epoch's start; inside: every evaluation inside a step, train() after it; eval_only: no training."""
    model = run.wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(model=model, opt=opt)
    for epoch in run.epochs(epochs):
        if how == "right":
            model.train()
        for i, (x, y) in run.steps(run.loader(Noisy(), batch_size=8)):
            if how == "eval_only":
                model.eval()
                with torch.no_grad():
                    model(x)
                continue
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            if how == "inside":
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
        if how in ("forgot", "right"):
            model.eval()


@pytest.mark.parametrize("how, said", [("forgot", True), ("right", False), ("inside", False), ("eval_only", False)])
def test_a_model_left_in_eval_mode_while_it_trains_is_said_once(tmp_path, base_cfg, caplog, how, said):
    caplog.set_level("WARNING", logger="expgpu")
    status, _, _ = run_task(tmp_path / how, base_cfg, "evaluates", how=how)
    lines = [r.getMessage() for r in caplog.records if "in eval mode" in r.getMessage()]
    assert status == "finished"
    if not said:
        assert lines == []
        return
    # 5 steps an epoch: the evaluation after step 5, and steps 6, 7, ... in eval mode; said at the second's end
    assert lines == ["model (Sequential) trained step 7 in eval mode: model.eval() by the end of step 6 and no "
                     "model.train() since, so its Dropout layers work as in an evaluation (no dropout; BatchNorm's "
                     "running statistics, not updated) while it trains: call model.train() after an evaluation (on "
                     "purpose, BatchNorm frozen: model.train(), then .eval() on those layers alone)"]


def test_ranks_that_waited_for_their_batches_are_said_with_what_keeps_the_loader_ahead():
    from expgpu.train.run_end import slow_data

    said = slow_data([0.1, 0.6], train_s=120.0, workers=0)
    assert said.startswith("rank 1 waited for batches 60% of the training time (run.steps taking the next one from "
                           "the loader and moving it to the device; result.json's plan[].data_wait): the data, not "
                           "the model, set the pace; the loader has no workers: data.num_workers=4")
    assert slow_data([0.3, 0.5], 120.0, workers=2).startswith("rank(s) 0, 1 waited for batches 50%")
    assert "the loader has 2 worker(s): more of them, persistent_workers=True" in slow_data([0.3], 120.0, 2)
    assert "2 worker(s): more of them, or less work" in slow_data([0.3], 120.0, 2, kept=True)   # persistent already
    assert "an iterable of your own: a DataLoader with workers" in slow_data([0.9], 120.0, None)
    assert slow_data([0.1, 0.2], 120.0, 0) is None      # the loader kept up
    assert slow_data([0.9], 5.0, 0) is None              # too short a run to tell (its workers' start)
    assert slow_data([None, None], 120.0, None) is None  # no loader


def test_a_pruned_run_saves_no_checkpoint_and_writes_what_it_logged(tmp_path, base_cfg):
    status, _, run = run_task(tmp_path / "run", base_cfg, "prunes_itself", log_every=5)
    assert (status, run.step, run.stop_signal) == ("stopped", 7, "PRUNED")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()   # final: a large model's save would hold the GPU
    assert [(r["step"], r["loss"]) for r in rows(tmp_path / "run")] == [(5, 5.0), (7, 7.0)]


def diverges(run: Run, max_steps: int = 200, at: int = 5):
    """A loss that becomes nan at step `at`, 20 ms a step: rows are written about once a second."""
    model = run.wrap(torch.nn.Linear(1, 1))
    run.track(model=model)
    for step, _ in run.steps(None, max_steps):
        time.sleep(0.02)
        run.log(loss=float("nan") if step + 1 >= at else 1.0)


def test_under_on_nonfinite_stop_a_diverged_run_stops_within_a_second_and_saves_nothing(tmp_path, base_cfg):
    status, _, run = run_task(tmp_path / "run", base_cfg, "diverges", log_every=1, on_nonfinite="stop")
    assert (status, run.stop_signal, run.final_stop) == ("stopped", "DIVERGED", True)   # the worker: "diverged"
    assert 5 <= run.step < 120, run.step   # at the next write of its rows (~1 s: step ~50), not at its end
    assert not (tmp_path / "run" / "checkpoint.pt").exists()   # final: its parameters are nan
    written = rows(tmp_path / "run")
    assert written[-1]["step"] == run.step and run._metrics.nonfinite.first == {"loss": 5}, written[-3:]


def test_rows_keep_the_last_value_of_each_log_every_window(tmp_path, base_cfg):
    run_task(tmp_path / "run", base_cfg, "regress", max_steps=25, log_every=10)
    assert [r["step"] for r in rows(tmp_path / "run")] == [10, 20, 25]


def test_a_finished_run_trained_on_by_its_length_key_continues_from_its_checkpoint(tmp_path, base_cfg):
    whole = run_task(tmp_path / "whole", base_cfg, "regress", max_steps=30)
    run_task(tmp_path / "run", base_cfg, "regress", max_steps=20)
    longer = run_task(tmp_path / "run", base_cfg, "regress", max_steps=30)
    assert longer[2].resumed_from_step == 20 and longer[2].checksums() == whole[2].checksums()
    assert longer[2].length_keys == ["max_steps"]


def test_other_settings_than_the_length_are_refused_at_the_resume(tmp_path, base_cfg):
    run_task(tmp_path / "run", base_cfg, "regress", stop_at=5)
    with pytest.raises(UserError) as caught:
        run_task(tmp_path / "run", base_cfg, "regress", lr=0.5)
    assert "lr" in str(caught.value) and "\n" not in str(caught.value)


def logs_as_other_tools_do(run: Run):
    for step, _ in run.steps(None, 2):
        run.log("loss", torch.tensor(step + 0.5))               # Lightning's self.log(name, value)
        run.log({"acc": step / 2, "lr": 0.1}, grad_norm=1.0)    # W&B's wandb.log(dict), accelerate's


def test_log_takes_a_name_and_a_value_or_a_dict_as_other_tools_do(tmp_path, base_cfg):
    run_task(tmp_path / "run", base_cfg, "logs_as_other_tools_do", log_every=1)
    assert [{k: r[k] for k in ("step", "loss", "acc", "lr", "grad_norm")} for r in rows(tmp_path / "run")] == [
        {"step": 1, "loss": 0.5, "acc": 0.0, "lr": 0.1, "grad_norm": 1.0},
        {"step": 2, "loss": 1.5, "acc": 0.5, "lr": 0.1, "grad_norm": 1.0}]


def logs_positional(run: Run, form: str = "three"):
    given = {"three": ("loss", 1.0, 2.0), "number": (1.0,), "int_keys": ({1: 1.0},), "step_in_dict": ({"step": 1},)}
    for _ in run.steps(None, 3):
        run.log(*given[form])


def gathers_alone(run: Run):
    value = {"t": torch.tensor([[1.0], [2.0]], requires_grad=True), "zero_d": torch.tensor(3), "n": 4, "w": ["a"]}
    out = run.gather(value)
    assert out["t"].tolist() == [[1.0], [2.0]] and not out["t"].requires_grad and out["t"] is not value["t"]
    assert out["zero_d"].tolist() == [3] and out["n"] == [4] and out["w"] == [["a"]]
    assert run.broadcast("mine") == "mine"
    return {"ok": 1}


def test_gather_and_broadcast_on_one_rank_are_the_value(tmp_path, base_cfg):
    assert run_task(tmp_path / "run", base_cfg, "gathers_alone")[:2] == ("finished", {"ok": 1})


def logs_step(run: Run):
    for _ in run.steps(None, 3):
        run.log(step=1)


def tracks_late(run: Run):
    for _ in run.steps(None, 3):
        run.track(model=torch.nn.Linear(1, 1))


def loops_twice(run: Run):
    for _ in run.steps(None, 2):
        pass
    for _ in run.steps(None, 2):
        pass


def no_length(run: Run):
    for _ in run.steps(None):
        pass


@pytest.mark.parametrize("fn, needle", [
    ("logs_step", "run.log(step=...): step, epoch and time are written with every row by expgpu"),
    ("logs_positional", "run.log(str, float, float): give name=value pairs (loss=loss), a name and a value ('loss', "
                        "loss) or a dict of names to values ({'loss': loss})"),
    ("logs_positional:number", "run.log(float): give name=value pairs"),
    ("logs_positional:int_keys", "run.log(dict): give name=value pairs"),
    ("logs_positional:step_in_dict", "run.log(step=...): step, epoch and time are written with every row"),
    ("tracks_late", "run.track(model): called after the training loop began"),
    ("loops_twice", "run.steps: called a second time"),
    ("no_length", "run.steps(loader): max_steps is missing"),
])
def test_a_misused_call_is_one_line(tmp_path, base_cfg, fn, needle):
    fn, _, form = fn.partition(":")
    with pytest.raises(UserError) as caught:
        run_task(tmp_path / "run", base_cfg, fn, **({"form": form} if form else {}))
    assert needle in str(caught.value) and "\n" not in str(caught.value)
