"""A script that is a Hydra app (@hydra.main) as a script task: args_style=hydra writes task.args as
its key=value overrides, which Hydra's own parser reads back to the values given; its Hydra writes into
the run dir beside expgpu's .hydra (never over it); a Hydra app under another style is one line. End to
end with examples/scripts/hydra_train (slow): two ranks, a rerun that resumes from its snapshot, and a
sweep over one of its config groups whose report names the sweep's overrides."""

from __future__ import annotations

import json
import math
import re

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from conftest import REPO, clean_env, expgpu, multirun
from expgpu.errors import UserError
from expgpu.script import hydra_app
from expgpu.script.spec import build

APP = """import hydra

@hydra.main(version_base="1.3", config_path=None)
def main(cfg):
    pass
"""


@pytest.fixture
def launch(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "aliased.py").write_text("from hydra import main as entry\n\n\n@entry(config_path=None)\ndef f(cfg):\n"
                                         "    pass\n")
    (tmp_path / "plain.py").write_text("'''Not one: hydra.main is only named here:\n"
                                       "@hydra.main(config_path=None)\n'''\nprint('hi')\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(APP)
    (tmp_path / "data").mkdir()
    return tmp_path


def read_back(words: list[str]) -> dict:
    """Each word as the app's Hydra parses it: key (with its + or ~) -> value."""
    parser = OverridesParser.create()
    out = {}
    for word in words:
        o = parser.parse_override(word)
        assert not o.is_sweep_override(), word
        key = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(o.type.name, "") + o.key_or_group
        out[key] = o.value()
    return out


def test_args_are_overrides_hydra_reads_back_as_given(launch):
    args = {"train": {"epochs": 3, "lr": 1e-5, "amp": False, "tag": "1e-3", "mode": "true", "pair": "a,b",
                      "quote": "it's \"x\"", "slash": "a\\'b\\", "pad": " x ", "none": None, "inf": math.inf},
            "model": "resnet", "layers": [64, "x y", None], "data": "data", "+extra.k": 1, "~drop": None}
    spec = build({"script": "app.py", "args_style": "hydra", "args": args}, launch)
    assert spec.args[:2] == hydra_app.OWN == ["hydra.run.dir=.", "hydra.output_subdir=.hydra/script"]
    got = read_back(spec.args[2:])
    assert got == {"train.epochs": 3, "train.lr": 1e-5, "train.amp": False, "train.tag": "1e-3",
                   "train.mode": "true", "train.pair": "a,b", "train.quote": "it's \"x\"", "train.slash": "a\\'b\\",
                   "train.pad": " x ", "train.none": None, "train.inf": math.inf, "model": "resnet",
                   "layers": [64, "x y", None], "data": str(launch / "data"), "+extra.k": 1, "~drop": None}
    assert type(got["train.epochs"]) is int and type(got["train.tag"]) is str   # '1e-3' stays a string
    assert "model=resnet" in spec.args and "~drop" in spec.args                 # quoted only where it must be


def test_own_settings_come_first_so_the_users_win_and_resume_args_merge(launch):
    task = {"script": "app.py", "args_style": "hydra", "args": {"hydra": {"run": {"dir": "mine"}}, "lr": 0.1},
            "resume_args": {"lr": 0.01, "resume": True}}
    spec = build(task, launch)
    assert spec.args == [*hydra_app.OWN, "hydra.run.dir=mine", "lr=0.1"]   # Hydra takes the last of a key
    assert spec.resume_args == [*hydra_app.OWN, "hydra.run.dir=mine", "lr=0.01", "resume=true"]
    listed = build({"script": "app.py", "args_style": "hydra", "args": ["lr=0.1", "+x=1"]}, launch)
    assert listed.args == [*hydra_app.OWN, "lr=0.1", "+x=1"]                 # a list: its words as given


@pytest.mark.parametrize("task, message", [
    ({"script": "app.py"}, r"^task\.script=app\.py is a Hydra app \(@hydra\.main at line 3 of .*app\.py\): set "
                           r"task\.args_style=hydra, .* not over expgpu's own \.hydra$"),
    ({"script": "app.py", "args_style": "equals", "args": {"lr": 0.1}}, r"^task\.script=app\.py is a Hydra app"),
    ({"module": "pkg.train"}, r"^task\.module=pkg\.train is a Hydra app \(@hydra\.main at line 3 of .*train\.py\)"),
    ({"script": "app.py", "args_style": "hydra", "args": {"a b": 1}},
     r"^task\.args\.a b: a b=1 is not a Hydra override \(.*\); args_style=hydra writes each key as key=value"),
], ids=["no_style", "equals", "module", "bad_key"])
def test_each_mistake_is_one_line(launch, task, message):
    with pytest.raises(UserError) as e:
        build(task, launch)
    assert re.search(message, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_a_script_that_only_names_hydra_main_is_not_taken_for_one(launch):
    assert build({"script": "plain.py", "args": {"lr": 0.1}}, launch).args == ["--lr", "0.1"]
    assert hydra_app.main_line(launch / "app.py") == 3 and hydra_app.main_line(launch / "plain.py") is None
    assert hydra_app.main_line(launch / "aliased.py") == 4   # from hydra import main as entry; @entry(...)


EXAMPLE = ["--config-dir", str(REPO / "examples" / "conf"), "task=hydra_script"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_example_app_on_two_ranks_keeps_expgpus_hydra_dir_and_resumes_from_its_snapshot(tmp_path):
    run = expgpu([*EXAMPLE, "launch.nproc_per_node=2", "task.args.optim.lr=0.02", "objective=loss"], tmp_path / "r")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["ranks"] == [0, 1] and summary["param_sums"][0] == summary["param_sums"][1]
    assert summary["cwd"] == str(run.run_dir) and summary["resumed_after"] == 0 and summary["steps"] == 48
    assert summary["config"]["optim"] == {"name": "sgd", "lr": 0.02, "momentum": 0.0}
    hydra_dir = run.run_dir / ".hydra"
    assert "task.args.optim.lr=0.02" in (hydra_dir / "overrides.yaml").read_text()      # expgpu's, as it wrote it
    assert "script: examples/scripts/hydra_train/train.py" in (hydra_dir / "config.yaml").read_text()
    assert "lr: 0.02" in (hydra_dir / "script" / "config.yaml").read_text()             # the app's, beside it
    assert (run.run_dir / "train.log").exists() and not (run.run_dir / "outputs").exists()
    assert run.result["exit_codes"] == [0, 0] and len(run.metrics()) == 48

    again = expgpu([*EXAMPLE, "launch.nproc_per_node=2", "task.args.optim.lr=0.02", "task.args.train.epochs=4"],
                   tmp_path / "r")
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["resumed_after"] == 3 and summary["steps"] == 16   # the 4th epoch only
    assert "rank 0: resuming from snapshot.pt after epoch 3" in again.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sweep_over_the_apps_config_group_is_reported_by_its_own_overrides(tmp_path):
    sweep = tmp_path / "sweep"
    proc = multirun([*EXAMPLE, "task.args.optim=sgd,adam", "objective=loss"], sweep, clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = [json.loads((sweep / str(n) / "summary.json").read_text())["config"]["optim"]["name"] for n in (0, 1)]
    assert ran == ["sgd", "adam"]
    assert "- task.args.optim=adam" in (sweep / "1" / ".hydra" / "overrides.yaml").read_text()
    assert "best: job 0 (task.args.optim=sgd), loss" in proc.stdout + proc.stderr
