"""A normal (non-editable) install finds its configs: conf/ ships inside the wheel, and its launchers
are every Hydra app's choices."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """The wheel, installed in a directory of its own; the environment that puts it first."""
    tmp_path = tmp_path_factory.mktemp("install")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("expgpu-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "expgpu/conf/config.yaml" in names and "expgpu/conf/task/digits.yaml" in names
    assert "expgpu/scripts/expgpu.sbatch" in names
    assert any(n.startswith("hydra_plugins/expgpu_launchers/") for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # PYTHONPATH comes before the editable checkout on sys.path: the installed copy wins.
    return site, clean_env(PYTHONPATH=str(site))


def test_wheel_ships_conf_and_runs_outside_the_checkout(installed, tmp_path):
    site, env = installed
    where = subprocess.run([sys.executable, "-c", "import expgpu; print(expgpu.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where
    run = subprocess.run([sys.executable, "-m", "expgpu", "task=digits", "task.max_steps=20",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["task"] == "digits" and result["steps"] == 20


def test_wheel_prints_the_sbatch_script_that_a_checkout_has(installed, tmp_path):
    printed = subprocess.run([sys.executable, "-m", "expgpu", "sbatch-script"], cwd=tmp_path, env=installed[1],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == (REPO / "scripts" / "expgpu.sbatch").read_text()


@pytest.mark.parametrize("launcher, target", [("slurm", "expgpu_launchers.slurm.ExpgpuSlurmLauncher"),
                                              ("gpu_pool", "expgpu_launchers.gpu_pool.GpuPoolLauncher"),
                                              # another plugin's name stays that plugin's
                                              ("submitit_local", "hydra_submitit_launcher.submitit_launcher."
                                                                 "LocalLauncher")])
def test_wheel_launchers_are_choices_of_any_app(installed, tmp_path, launcher, target):
    (tmp_path / "my_app.py").write_text("import hydra\n\n\n@hydra.main(version_base='1.3', config_path=None)\n"
                                        "def main(cfg):\n    pass\n\n\nmain()\n")
    shown = subprocess.run([sys.executable, "my_app.py", f"hydra/launcher={launcher}", "--cfg", "hydra",
                            "-p", "hydra.launcher._target_"], cwd=tmp_path, env=installed[1],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"hydra_plugins.{target}", shown.stdout


def test_wheel_sweeper_and_its_groups_serve_any_app(installed, tmp_path):
    (tmp_path / "my_app.py").write_text("import hydra\n\n\n@hydra.main(version_base='1.3', config_path=None)\n"
                                        "def main(cfg):\n    return (cfg.x - 0.25) ** 2\n\n\nmain()\n")
    shown = subprocess.run([sys.executable, "my_app.py", "+x=0", "hydra/sweeper=expgpu_optuna",
                            "hydra/sweeper/sampler=random", "hydra/sweeper/pruner=median", "--cfg", "hydra", "-p",
                            "hydra.sweeper"], cwd=tmp_path,
                           env=installed[1], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "_target_: optuna.samplers.RandomSampler" in shown.stdout
    assert "_target_: optuna.pruners.MedianPruner" in shown.stdout
    swept = subprocess.run([sys.executable, "my_app.py", "-m", "hydra/sweeper=expgpu_optuna",
                            "hydra.sweeper.n_trials=3", "+x=interval(0,1)", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                           cwd=tmp_path,
                           env=installed[1], capture_output=True, text=True, timeout=120)
    assert swept.returncode == 0, swept.stderr
    assert "best_value" in (tmp_path / "sweep" / "optimization_results.yaml").read_text()
