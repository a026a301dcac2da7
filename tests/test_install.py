"""A normal (non-editable) install finds its configs: conf/ ships inside the wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow


def test_wheel_ships_conf_and_runs_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("expgpu-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "expgpu/conf/config.yaml" in names and "expgpu/conf/task/digits.yaml" in names
    assert any(n.startswith("hydra_plugins/expgpu_launchers/") for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # PYTHONPATH comes before the editable checkout on sys.path: the installed copy wins.
    env = clean_env(PYTHONPATH=str(site))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([sys.executable, "-c", "import expgpu; print(expgpu.__file__)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where
    run = subprocess.run([sys.executable, "-m", "expgpu", "task=digits", "task.max_steps=20",
                          f"hydra.run.dir={elsewhere / 'run'}"], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    result = json.loads((elsewhere / "run" / "result.json").read_text())
    assert result["task"] == "digits" and result["steps"] == 20
