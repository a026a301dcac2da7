"""Hydra composes a run's config once only to read hydra.mode, which expgpu skips where the command line brings no
config of the user's (expgpu.__main__._skip_mode_composition): for that to change nothing, no config expgpu or its
plugins ship may set hydra.mode, and a user's config that does is still read."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType

from conftest import clean_env
from expgpu import __main__ as cli
from expgpu import rundir, schema


def _groups(loader, parent: str = "") -> list[str]:
    found = []
    for name in loader.list_groups(parent):
        group = f"{parent}/{name}" if parent else name
        found += [group, *_groups(loader, group)]
    return found


@pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/submitit_local' is validated against")   # as the CLI does
def test_no_config_that_expgpu_or_its_plugins_ship_sets_hydra_mode():
    schema.register()
    rundir.register()
    GlobalHydra.instance().clear()
    seen = 0
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for group in _groups(loader):
            if group == "hydra":   # Hydra's own primary config (hydra/config), not a group one chooses from
                continue
            # a sweeper's sampler or pruner is chosen under its sweeper
            under = ["hydra/sweeper=expgpu_optuna"] if group.startswith("hydra/sweeper/") else []
            for option in loader.get_group_options(group, results_filter=ObjectType.CONFIG):
                cfg = compose("config", overrides=[*under, f"{group}={option}"], return_hydra_config=True)
                assert cfg.hydra.mode is None, f"{group}={option} sets hydra.mode={cfg.hydra.mode}"
                seen += 1
    assert seen > 40   # every group's options: task, gpu_map, ..., hydra/launcher, hydra/sweeper and Hydra's own


@pytest.mark.parametrize("args, skipped", [
    (["task=a", "gpu_map=ranked"], True),
    (["-m", "task=a,b"], True),
    (["--config-dir", "my_conf", "task=mine"], False),
    (["-cd=my_conf", "task=mine"], False),
    (["experiment=big"], False),
    (["hydra.mode=MULTIRUN"], False),
    (["+hydra.searchpath=[file://my_conf]"], False),
])
def test_the_first_composition_is_skipped_only_where_no_config_of_the_users_can_set_the_mode(monkeypatch, args,
                                                                                            skipped):
    from hydra._internal.hydra import Hydra

    monkeypatch.setattr(Hydra, "get_mode", Hydra.get_mode)   # put back after the test
    original = Hydra.get_mode
    cli._skip_mode_composition(args)
    assert (Hydra.get_mode is not original) == skipped
    if skipped:
        assert Hydra.get_mode(None, "config", args) is None


@pytest.mark.slow
def test_a_users_experiment_that_sets_multirun_still_makes_a_sweep_without_m(tmp_path):
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "pair.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      task.seed: 0,1\n")
    done = subprocess.run([sys.executable, "-m", "expgpu", "--config-dir", str(tmp_path / "conf"), "experiment=pair",
                           "task=a", "task.max_steps=5", "logger=none", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all((tmp_path / "sweep" / str(n) / "result.json").exists() for n in (0, 1)), done.stderr[-3000:]
