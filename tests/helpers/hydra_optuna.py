"""Hydra's own optuna sweeper for the tests that check `objective` with it (test_objective.py, the pool's
batches in test_pool_jobs.py): it pins optuna<3, which cannot share the environment with expgpu's sweeper
(optuna>=5), so it lives in a directory of its own, put first on those tests' subprocesses' PYTHONPATH.

Installed once next to the environment (<venv>/hydra-optuna-sweeper), then reused: `pip install --target`,
without dependencies, since the environment has optuna 2.10's, all but cmaes (optuna 5 does without it),
installed with them; a lock keeps pytest-xdist's workers from installing it twice at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# cmaes: optuna 2.10 imports it with its samplers; optuna 5 (the environment's) does not need it
PACKAGES = ["hydra-optuna-sweeper==1.2.0", "optuna==2.10.1", "cmaes==0.8.2"]
WHERE = Path(sys.prefix) / "hydra-optuna-sweeper"


def install() -> Path:
    """The directory holding Hydra's optuna sweeper and optuna 2.10, installed if missing."""
    from filelock import FileLock

    done = WHERE / ".installed"
    with FileLock(str(WHERE) + ".lock", timeout=600):
        if not done.exists() or done.read_text() != " ".join(PACKAGES):
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                   "--no-deps", "--upgrade", "--target", str(WHERE), *PACKAGES],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                pytest.fail(f"could not install {' '.join(PACKAGES)} into {WHERE}: {proc.stderr[-2000:]}")
            done.write_text(" ".join(PACKAGES))
    return WHERE


@pytest.fixture(scope="session")
def hydra_optuna() -> str:
    """A PYTHONPATH entry that puts Hydra's optuna sweeper (and optuna 2.10) first."""
    return str(install())


def with_path(env: dict[str, str], first: str) -> dict[str, str]:
    """`env` with `first` at the front of its PYTHONPATH."""
    rest = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": first + (os.pathsep + rest if rest else "")}
