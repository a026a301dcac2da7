"""Script tasks without processes: the task file's keys -> the script's command line (three args
styles, paths made absolute), every bad input as one line, and the environment each rank's script
gets (torchrun's variables, the GPU mask under both isolations) on simulated nodes."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from conftest import clean_env
from expgpu.errors import UserError
from expgpu.gpus import inventory, plan
from expgpu.ranks import RankInfo
from expgpu.script import environ
from expgpu.script.spec import build, prepare


@pytest.fixture
def launch(tmp_path):
    """A launch dir as a user has it: the script, its data, a package runnable with -m."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "data" / "wikitext-2").mkdir(parents=True)
    (tmp_path / "configurator.py").write_text("")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text("")
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("raise ImportError('no numpy here')\n")
    return tmp_path


def plain(task: dict, **launch) -> dict:
    return {"task": {"name": "t", "seed": 0, "precision": 32, **task},
            "launch": {"isolation": "auto", **launch}, "checkpoint": {"verify": False}}


def words(task: dict, launch_dir: Path, resume: bool = False) -> list[str]:
    spec = build({"script": "train.py", **task}, launch_dir)
    return spec.argv(resume)[2:]


def test_args_space_style_is_argparse_style(launch):
    got = words({"args": {"lr": 0.01, "epochs": 2, "tied": True, "dry-run": False, "seed": None,
                          "layers": [64, 32], "model": "LSTM", "-n": 3}}, launch)
    assert got == ["--lr", "0.01", "--epochs", "2", "--tied", "--layers", "64", "32", "--model", "LSTM", "-n", "3"]


def test_args_equals_style(launch):
    assert words({"args_style": "equals", "args": {"lr": 1e-3, "tied": True, "name": "a b"}}, launch) == \
        ["--lr=0.001", "--tied", "--name=a b"]


def test_args_configurator_style_reads_back_as_nanogpt_reads_it(launch):
    got = words({"args_style": "configurator",
                 "args": {"compile": False, "device": "cpu", "learning_rate": 1e-3, "max_iters": 20,
                          "tag": "1e-3", "wandb_log": True, "init": None}}, launch)
    assert got == ["--compile=False", "--device=cpu", "--learning_rate=0.001", "--max_iters=20",
                   "--tag='1e-3'", "--wandb_log=True", "--init=None"]

    def as_nanogpt(word):   # configurator.py: split at '=', literal_eval, else the string
        key, val = word.split("=")
        try:
            return key[2:], ast.literal_eval(val)
        except (SyntaxError, ValueError):
            return key[2:], val
    assert dict(map(as_nanogpt, got)) == {"compile": False, "device": "cpu", "learning_rate": 1e-3,
                                          "max_iters": 20, "tag": "1e-3", "wandb_log": True, "init": None}


def test_a_nested_mapping_is_dotted_flags_in_every_style(launch):
    args = {"trainer": {"learning_rate": 5e-4, "max_iters": 10, "compile": True}, "system": {"seed": 3}}
    assert words({"args": args}, launch) == ["--trainer.learning_rate", "0.0005", "--trainer.max_iters", "10",
                                             "--trainer.compile", "--system.seed", "3"]
    assert words({"args_style": "equals", "args": args}, launch) == [
        "--trainer.learning_rate=0.0005", "--trainer.max_iters=10", "--trainer.compile", "--system.seed=3"]
    assert words({"args_style": "configurator", "args": {"trainer": {"lr": 1e-3, "tag": "1e-3"}}}, launch) == \
        ["--trainer.lr=0.001", "--trainer.tag='1e-3'"]
    # resume_args merge into args key by key, nested ones too
    task = {"args": args, "resume_args": {"trainer": {"max_iters": 20, "resume": True}}}
    assert words(task, launch, resume=True) == [
        "--trainer.learning_rate", "0.0005", "--trainer.max_iters", "20", "--trainer.compile", "--trainer.resume",
        "--system.seed", "3"]


def test_paths_under_the_launch_dir_are_passed_absolute_inputs_stay_relative(launch):
    got = words({"args": {"data": "data/wikitext-2", "save": "model.pt", "cfg": "configurator.py"},
                 "inputs": ["configurator.py"]}, launch)
    assert got == ["--data", str(launch / "data" / "wikitext-2"), "--save", "model.pt", "--cfg", "configurator.py"]
    assert words({"args": ["--data", "./data/wikitext-2", "--epochs", 1]}, launch) == \
        ["--data", str(launch / "data" / "wikitext-2"), "--epochs", "1"]


def test_resume_args_merge_into_args_or_follow_them(launch):
    task = {"args_style": "configurator", "args": {"init_from": "scratch", "max_iters": 5},
            "resume_args": {"init_from": "resume"}}
    assert words(task, launch) == ["--init_from=scratch", "--max_iters=5"]
    assert words(task, launch, resume=True) == ["--init_from=resume", "--max_iters=5"]
    assert words({"args": ["--epochs", 2], "resume_args": {"resume": True}}, launch, resume=True) == \
        ["--epochs", "2", "--resume"]


def test_script_module_and_launch_dir_resolve(launch):
    spec = build({"script": "train.py"}, launch)
    assert spec.command == [sys.executable, str(launch / "train.py")] and spec.name == "train"
    spec = build({"module": "mypkg.train", "name": "mine"}, launch)
    assert spec.command == [sys.executable, "-m", "mypkg.train"] and spec.module and spec.name == "mine"
    assert str(launch) not in sys.path   # looked for there, and left sys.path as it was


BAD = [
    ({"script": "nope.py"}, r"task\.script=nope\.py: .*nope\.py does not exist \(a script path is relative to the "
                            r"directory you launched from"),
    ({"script": "data"}, r"task\.script=data: .* is a directory"),
    ({"module": "nosuch.train"}, r"task\.module=nosuch\.train: no module named 'nosuch\.train'"),
    ({"module": "mypkg"}, r"task\.module=mypkg: a package without __main__\.py"),
    ({"module": "brokenpkg.train"}, r"task\.module=brokenpkg\.train: importing its package failed: "
                                    r"ImportError: no numpy here"),
    ({"module": "my-pkg"}, r"task\.module='my-pkg' is not allowed: a module name"),
    ({"script": "train.py", "module": "mypkg.train"},
     r"task\.script=train\.py and task\.module=mypkg\.train: name one"),
    ({"script": "train.py", "_target_": "my.train"}, r"task\._target_=my\.train and task\.script: a task is a function "
                                                     r"\(_target_\) or a script"),
    ({"script": "train.py", "args": 3}, r"task\.args=3 is not allowed: a mapping of the script's arguments"),
    ({"script": "train.py", "args": {"opt": {"lr": [[1]]}}}, r"task\.args\.opt\.lr=\[\[1\]\] is not allowed: a "
                                                             r"number, string, true/false, null, a list of those"),
    ({"script": "train.py", "args": ["--x", [1]]}, r"task\.args\[1\]=\[1\] is not allowed"),
    ({"script": "train.py", "args_style": "posix"}, r"task\.args_style='posix' is not allowed: one of space "
                                                    r"\(--key value\); equals"),
    ({"script": "train.py", "args_style": "equals", "args": {"l": [1, 2]}}, r"args_style=equals passes one value"),
    ({"script": "train.py", "args_style": "configurator", "args": {"f": "a=b"}}, r"cannot pass '=' in a key or value"),
    ({"script": "train.py", "lr": 0.1}, r"task\.lr: a script task has no key 'lr' \(did you mean task\.args\.lr\?\)"),
    ({"script": "train.py", "resume_arg": {}}, r"task\.resume_arg: .*did you mean task\.resume_args\?"),
    ({"script": "train.py", "seed": 3}, r"task\.seed=3 does not apply to a script task .* task\.args\.seed=3"),
    ({"script": "train.py", "on_nonfinite": "stop"}, r"task\.on_nonfinite='stop' does not apply to a script task \(it "
                                                    r"stops a task function's run\.steps\)"),
    ({"script": "train.py", "inputs": ["datum"]}, r"task\.inputs\[0\]='datum': .*datum does not exist"),
    ({"script": "train.py", "inputs": ["../x"]}, r"task\.inputs\[0\]='\.\./x': give it relative to the launch dir"),
    ({"script": "train.py", "inputs": "data"}, r"task\.inputs='data' is not allowed: a list of paths"),
    ({"script": "train.py", "grace_s": 0}, r"task\.grace_s=0 is not allowed: seconds > 0"),
    ({"script": "train.py", "resume_if": 5}, r"task\.resume_if=5 is not allowed"),
]


@pytest.mark.parametrize("task, message", BAD, ids=[m[:40] for _, m in BAD])
def test_each_bad_input_is_one_line_naming_it(launch, task, message):
    with pytest.raises(UserError) as e:
        prepare(plain(task), launch)
    assert re.search(message, str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def test_launch_settings_a_script_cannot_honour(launch):
    with pytest.raises(UserError, match=r"launch\.isolation=set_device is not allowed for a script task"):
        prepare(plain({"script": "train.py"}, isolation="set_device"), launch)
    cfg = plain({"script": "train.py"})
    cfg["checkpoint"]["verify"] = True
    with pytest.raises(UserError, match=r"checkpoint\.verify=true .* a script task keeps its own"):
        prepare(cfg, launch)


@pytest.mark.parametrize("section, key, value, why", [
    ("launch", "wrap", "fsdp", "the script wraps its own model"),
    ("launch", "fsdp.units", ["Block"], "the script wraps its own model"),
    ("launch", "ddp.find_unused_parameters", True, "the script wraps its own model"),
    ("checkpoint", "every_steps", 100, "the script keeps its own checkpoints (task.resume_args)"),
    ("checkpoint", "format", "dcp", "the script keeps its own checkpoints (task.resume_args)"),
    ("data", "shard", "proportional", "the script loads its own data"),
    ("faults", "crash_rank", 1, "expgpu injects faults into run.steps, which a script does not call"),
    ("backend", "name", "nccl", "the script makes its own process group (init_process_group's backend)"),
])
def test_settings_only_a_task_function_reads_are_refused_for_a_script(launch, section, key, value, why):
    cfg = plain({"script": "train.py"})
    where, _, inner = key.partition(".")   # launch.fsdp.units: a key inside a section's dict
    cfg.setdefault(section, {})[where] = {inner: value} if inner else value
    with pytest.raises(UserError) as e:
        prepare(cfg, launch)
    assert str(e.value) == f"{section}.{key}={value} is not read by a script task: {why}; drop the key"
    default = {"wrap": "ddp", "fsdp.units": None, "ddp.find_unused_parameters": False, "every_steps": 0,
               "format": "auto", "shard": "uniform", "crash_rank": None, "name": "auto"}[key]
    cfg[section][where] = {inner: default} if inner else default
    prepare(cfg, launch)   # at its default: no error


def test_a_function_task_is_left_alone(launch):
    cfg = plain({"_target_": "my.train", "lr": 1})
    prepare(cfg, launch)
    assert "script" not in cfg


# -- each rank's environment -------------------------------------------------------------------------

SIM = [{"name": n, "memory_mb": 16384} for n in ("T4", "H100", "A100", "V100")]


def spawned(rank: int, world: int = 2, port: int = 29600) -> RankInfo:
    return RankInfo(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node_rank=0,
                    master_addr="127.0.0.1", master_port=port, source="local")


def test_torchrun_variables_of_a_spawned_rank():
    assert environ.torchrun_variables(spawned(1), "abc", restarts=2) == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def test_slurm_ranks_on_two_nodes_and_worlds_without_variables():
    srun = RankInfo(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, master_addr="gpu-001",
                    master_port=15123, source="slurm", num_nodes=2)
    got = environ.torchrun_variables(srun, "slurm-7.0.0", 0)
    assert (got["RANK"], got["LOCAL_RANK"], got["GROUP_RANK"], got["GROUP_WORLD_SIZE"], got["MASTER_ADDR"],
            got["MASTER_PORT"]) == ("5", "1", "1", "2", "gpu-001", "15123")
    alone = RankInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, master_addr="127.0.0.1",
                     master_port=0, source="single")
    assert environ.torchrun_variables(alone, "x", 0) == {}   # `python train.py`: nanoGPT takes RANK for DDP
    torchrun = RankInfo(rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0,
                        master_addr="127.0.0.1", master_port=29500, source="torchrun")
    assert environ.torchrun_variables(torchrun, "x", 0) == {}   # torchrun's own, passed through


def masks(gpu_map: dict, ranks: int, isolation: str, gpus=SIM) -> list[str]:
    node = plan(inventory(gpus, env={}), ranks, gpu_map)
    return [",".join(str(g.index) for g in environ.visible_gpus(node, r, isolation)) for r in range(ranks)]


def test_gpu_masks_under_both_isolations():
    # ranked: best first (H100 -> rank 0, A100 -> rank 1); only the planned GPUs are visible
    assert masks({"strategy": "ranked"}, 2, "auto") == ["1,2", "1,2"]            # cuda:LOCAL_RANK is its own
    assert masks({"strategy": "ranked"}, 2, "visible_devices") == ["1", "2"]     # cuda (cuda:0) is its own
    assert masks({"strategy": "custom", "gpus": [3, 0]}, 2, "auto") == ["3,0", "3,0"]
    # two GPUs per rank: rank r's at positions 2r, 2r+1
    assert masks({"strategy": "sequential", "gpus_per_rank": 2}, 2, "auto") == ["0,1,2,3", "0,1,2,3"]
    assert masks({"strategy": "sequential", "gpus_per_rank": 2}, 2, "visible_devices") == ["0,1", "2,3"]
    assert masks({"strategy": "sequential"}, 2, "auto", gpus=[]) == ["", ""]     # a CPU node


def test_shared_gpus_cannot_be_one_ordered_mask():
    with pytest.raises(UserError, match=r"gpu_map\.share=true .* use launch\.isolation=visible_devices"):
        masks({"strategy": "sequential", "share": True}, 3, "auto", gpus=SIM[:2])
    assert masks({"strategy": "sequential", "share": True}, 3, "visible_devices", gpus=SIM[:2]) == ["0", "1", "0"]


def test_child_env_sets_what_the_script_needs_and_keeps_the_users(tmp_path):
    node = plan(inventory(SIM, env={}), 2, {"strategy": "sequential"})
    base = {"PATH": "/bin", "EXPGPU_RANK": "1", "EXPGPU_LAUNCH_ID": "x", "PYTHONPATH": "/mine",
            "CUDA_DEVICE_ORDER": "FASTEST_FIRST", "PYTHONUNBUFFERED": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    env = environ.child_env(base, spawned(1), node, "auto", run_dir=tmp_path, launch_dir="/launch", module=True,
                            run_id="abc", restarts=0, resumed=True)
    assert "EXPGPU_RANK" not in env and "EXPGPU_LAUNCH_ID" not in env   # expgpu's spawn's, not the script's
    assert env["PYTHONPATH"] == "/launch:/mine" and env["PATH"] == "/bin"
    assert env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"                      # never overwritten: GPUs by UUID
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-sim-0,GPU-sim-1"
    assert (env["PYTHONUNBUFFERED"], env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("0", "3")
    assert env["EXPGPU_SCRIPT_RUN_DIR"] == str(tmp_path) and env["EXPGPU_SCRIPT_RESUMED"] == "1"
    assert env["RANK"] == "1" and env["MASTER_PORT"] == "29600"


# -- expgpu.log in the script's process ---------------------------------------------------------------

def _rows(run_dir: Path) -> list[tuple]:
    import json

    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r.get("loss"), r["epoch"]) for r in rows]


def _attempt(run_dir: Path, resumed: bool, steps: list, epoch=None) -> None:
    from expgpu.script.log import _ScriptLog

    sink = _ScriptLog(run_dir, resumed)
    for step in steps:
        sink.log(step, {"loss": float(step if step is not None else -1), **({"epoch": epoch} if epoch else {})})
    sink.close()


def test_expgpu_log_takes_other_tools_forms_and_refuses_the_rest_where_it_is_called(tmp_path):
    import json
    import subprocess

    code = ("import expgpu\n"
            "expgpu.log(loss=0.5, step=1)\n"
            "expgpu.log({'loss': 0.25, 'acc': 0.5}, step=2)   # wandb.log's\n"
            "expgpu.log('loss', 0.125, step=3)                # Lightning's self.log\n"
            "expgpu.log(4, 10, loss=0.0625)                   # the step (and max_steps) by position, as before\n"
            "try:\n"
            "    expgpu.log(0.5, loss=1.0)\n"
            "except TypeError as e:\n"
            "    print(e)\n")
    for env in ({"EXPGPU_SCRIPT_RUN_DIR": str(tmp_path), "RANK": "0"}, {}):   # a script expgpu runs; plain python
        done = subprocess.run([sys.executable, "-c", code], env={**clean_env(), **env}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == ("expgpu.log(float): give name=value pairs (loss=loss), a name and a value "
                                       "('loss', loss) or a dict of names to values ({'loss': loss}); step= and "
                                       "max_steps= by name")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r.get("acc")) for r in rows] == [(1, 0.5, None), (2, 0.25, 0.5), (3, 0.125, None),
                                                                   (4, 0.0625, None)]
    assert rows[-1]["max_steps"] == 10


def test_expgpu_log_history_follows_the_script_across_attempts(tmp_path):
    _attempt(tmp_path, False, [1, 2, 3, 4, 5, 6])
    # resumed from its checkpoint at step 4: the rows it logged after it (5, 6) are logged again
    _attempt(tmp_path, True, [5, 6, 7], epoch=2)
    assert _rows(tmp_path) == [(1, 1.0, 0), (2, 2.0, 0), (3, 3.0, 0), (4, 4.0, 0), (5, 5.0, 2), (6, 6.0, 2),
                               (7, 7.0, 2)]
    _attempt(tmp_path, True, [None, None])          # no step=: on after the last row
    assert [r[0] for r in _rows(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _attempt(tmp_path, False, [None, None])         # started afresh: so is its history
    assert [r[0] for r in _rows(tmp_path)] == [0, 1]


def _names(run_dir: Path) -> list[tuple]:
    """(step, name, value) of every loss and val_loss in metrics.jsonl, sorted."""
    from expgpu.loggers.jsonl import read_rows

    rows = read_rows(run_dir / "metrics.jsonl")
    return sorted((r["step"], name, r[name]) for r in rows for name in ("loss", "val_loss") if name in r)


def test_a_script_resumed_at_its_checkpoints_step_keeps_what_it_does_not_log_there_again(tmp_path):
    from expgpu.script.log import _ScriptLog

    first = _ScriptLog(tmp_path, False)
    for step in (1, 2, 3):
        first.log(step, {"loss": float(step)})
    first.log(3, {"val_loss": 0.5})
    first.close()
    # resumed from its checkpoint at step 3, it evaluates again there (at its start, or its end):
    # its val_loss at 3 replaces the earlier one; the loss at 3, not logged again, stays
    again = _ScriptLog(tmp_path, True)
    again.log(3, {"val_loss": 0.25})
    again.log(4, {"loss": 4.0})
    again.close()
    assert _names(tmp_path) == [(1, "loss", 1.0), (2, "loss", 2.0), (3, "loss", 3.0), (3, "val_loss", 0.25),
                                (4, "loss", 4.0)]
    last = _ScriptLog(tmp_path, True)   # resumed at its last step: only its final evaluation runs again
    last.log(4, {"val_loss": 0.125})
    last.close()
    assert _names(tmp_path)[-2:] == [(4, "loss", 4.0), (4, "val_loss", 0.125)]
    assert len(_names(tmp_path)) == 6


def test_rows_held_over_by_an_attempt_killed_at_its_first_step_are_not_lost(tmp_path):
    import subprocess
    import sys

    from expgpu.script.log import _ScriptLog

    first = _ScriptLog(tmp_path, False)
    for step in (1, 2):
        first.log(step, {"loss": float(step)})
    first.close()
    # resumed at step 2, it logs val_loss there and is killed before it logs another step or exits
    killed = ("import os, sys; from pathlib import Path; from expgpu.script.log import _ScriptLog\n"
              "s = _ScriptLog(Path(sys.argv[1]), True); s.log(2, {'val_loss': 0.5}); s.metrics.write_out()\n"
              "os._exit(9)")
    assert subprocess.run([sys.executable, "-c", killed, str(tmp_path)]).returncode == 9
    assert _names(tmp_path) == [(1, "loss", 1.0), (2, "val_loss", 0.5)]   # the loss at 2 is held, not gone
    again = _ScriptLog(tmp_path, True)   # resumed at step 2 again
    again.log(2, {"val_loss": 0.25})
    again.close()
    assert _names(tmp_path) == [(1, "loss", 1.0), (2, "loss", 2.0), (2, "val_loss", 0.25)]


def test_expgpu_log_refuses_a_rows_own_keys(tmp_path):
    from expgpu.script.log import _ScriptLog

    with pytest.raises(ValueError, match=r"expgpu\.log\(time=\.\.\.\): a row's own key"):
        _ScriptLog(tmp_path, False).log(None, {"time": 1.0})
    with pytest.raises(ValueError, match=r"expgpu\.log\(step=1\.5\): an integer"):
        _ScriptLog(tmp_path, False).log(1.5, {"loss": 1.0})


@pytest.mark.parametrize("code, tail, refused", [
    (2, ["usage: train.py [-h] [--lr LR]", "train.py: error: unrecognized arguments: --bogus 3"],
     "train.py: error: unrecognized arguments: --bogus 3"),                         # argparse
    (2, ["Usage: train.py [OPTIONS]", "Try 'train.py --help' for help.", "", "Error: No such option: --bogus"],
     "Error: No such option: --bogus"),                                                # click
    (2, ["Usage: train.py [OPTIONS]", "Try 'train.py --help' for help.", "╭─ Error ──────────────────────╮",
         "│ No such option: --bogus Did you │", "│ mean --bogs?                   │", "╰──────────────────────╯"],
     "Error: No such option: --bogus Did you mean --bogs?"),                            # typer (rich's box)
    (2, ["Traceback (most recent call last):", "ValueError: error: bad shape"], None),  # a crash that exits 2
    (1, ["usage: train.py [-h]", "train.py: error: the following arguments are required: --data"], None),
    (2, ["usage: train.py [-h]", "train.py: error: bad", "then it went on and failed"], None),
])
def test_a_refusal_by_the_scripts_argument_parser_is_told_from_a_crash(code, tail, refused):
    from expgpu.script.result import refused_arguments
    assert refused_arguments({"exit_code": code, "signal": None, "stderr_tail": tail}) == refused


@pytest.mark.parametrize("signal, tail, torn", [
    ("SIGABRT", ["terminate called without an active exception"], True),         # an exit amid gloo's threads
    ("SIGABRT", ["epoch 3 loss 0.12", "terminate called without an active exception", ""], True),
    ("SIGABRT", ["Traceback (most recent call last):", "  File \"train.py\", line 9", "RuntimeError: boom",
                 "terminate called without an active exception"], False),       # it failed first: its traceback
    ("SIGABRT", ["free(): invalid pointer"], False),                             # a crash in its work
    ("SIGSEGV", ["terminate called without an active exception"], False),
    (None, ["terminate called without an active exception"], False),
])
def test_a_script_that_aborted_in_its_exit_is_told_from_one_that_crashed(tmp_path, signal, tail, torn):
    from expgpu.script.result import failure, torn_down
    record = {"rank": 1, "exit_code": -6 if signal == "SIGABRT" else -11 if signal else 1, "signal": signal,
              "stderr_tail": tail}
    assert torn_down(record) is torn
    line = failure(record, tmp_path).message
    assert ("aborted as it exited, its Python code done with no traceback" in line) is torn, line
    assert str(tmp_path / "logs" / "rank1.script.log") in line


def test_a_scripts_own_error_is_the_cause_before_a_peers_echo_and_a_timeout_names_who_ran_on(tmp_path):
    from expgpu.script.result import failure, first_failure

    def rec(rank, ended, last):
        return {"rank": rank, "ended": ended, "exit_code": 1, "signal": None, "stopped_by": None,
                "stderr_tail": ["Traceback (most recent call last):", f"[rank{rank}]: {last}"]}
    timeout = "RuntimeError: [/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"
    echo = "RuntimeError: [/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6345"
    # the echo ended first (its peer's supervisor was slow to see the kill): the own error is still the cause
    assert first_failure([rec(0, 10.5, "ValueError: bad batch"), rec(1, 10.0, echo)])["rank"] == 0
    assert first_failure([rec(0, 10.0, "ValueError: a"), rec(1, 9.0, "ValueError: b")])["rank"] == 1
    records = [rec(0, 10.0, timeout), rec(1, 17.0, echo), None]
    line = failure(records[0], tmp_path, records=records).message
    assert line.startswith("its script's collective timed out (RuntimeError: Timed out waiting 3000ms for recv "
                           "operation) while rank 1's script ran on for 7 s and rank 2's script still ran 10 s "
                           "later: work one rank does alone"), line
    # nobody ran on past it (they all ended with it), or no records: the plain line
    assert failure(records[0], tmp_path, records=[records[0], rec(1, 10.3, echo)]).message.startswith(
        "its script exited with code 1")
    assert failure(records[0], tmp_path).message.startswith("its script exited with code 1")


def test_a_scripts_nan_loss_is_said_without_a_stop_it_cannot_have(tmp_path, caplog):
    # task.on_nonfinite=stop is refused for a script task (its loop is its own): the line must not offer it
    from expgpu.script.log import _ScriptLog

    sink = _ScriptLog(tmp_path, False)
    with caplog.at_level("WARNING", logger="expgpu"):
        for step in (1, 2, 3):
            sink.log(step, {"loss": float("nan") if step >= 2 else 1.0})
        sink.close()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith("loss is nan at step 2, the first logged value of it that is not a "
                                                 "finite number; the script goes on (a learning rate"), said
