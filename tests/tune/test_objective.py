"""`objective=<metric>`: Hydra's optimizing sweepers (hydra-optuna-sweeper) drive expgpu runs under
the basic launcher, gpu_pool and submitit_local; the study's best is the best job's metric. Hydra's
sweeper and its optuna<3 come from a directory of their own (tests/helpers/hydra_optuna.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra_optuna import hydra_optuna, with_path  # noqa: F401  (a fixture)

from conftest import REPO, clean_env, expgpu

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STUDY = ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=0",
         "task.optimizer.lr=interval(0.001,0.1)", "task=b", "task.max_steps=20"]
LAUNCHERS = {
    "basic": ["hydra.sweeper.n_jobs=1"],
    "gpu_pool": ["hydra.sweeper.n_jobs=2", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2"],
    "submitit_local": ["hydra.sweeper.n_jobs=3", "hydra/launcher=submitit_local"],
}


def _sweep(args: list[str], sweep_dir: Path, path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=REPO, env=with_path(clean_env(), path), capture_output=True, text=True, timeout=280)


def _jobs(sweep_dir: Path) -> list[tuple[dict, dict]]:
    """(overrides as a dict, result.json) of every job dir."""
    out = []
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and (p / "result.json").exists()):
        overrides = yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text())
        out.append((dict(o.split("=", 1) for o in overrides), json.loads((d / "result.json").read_text())))
    return out


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_three_trial_study_minimizes_the_returned_metric(tmp_path, launcher, hydra_optuna):
    proc = _sweep(STUDY + LAUNCHERS[launcher] + ["objective=eval_loss"], tmp_path / "sweep", hydra_optuna)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = _jobs(tmp_path / "sweep")
    assert len(jobs) == 3
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    overrides, result = min(jobs, key=lambda j: j[1]["metrics"]["eval_loss"])
    assert best["best_value"] == result["metrics"]["eval_loss"]
    assert best["best_params"]["task.optimizer.lr"] == float(overrides["task.optimizer.lr"])
    assert len({o["task.optimizer.lr"] for o, _ in jobs}) == 3   # the sampler proposed 3 learning rates


def test_several_objectives_make_a_pareto_front(tmp_path, hydra_optuna):
    args = STUDY + LAUNCHERS["basic"] + ["objective=[eval_loss,accuracy]",
                                         "hydra.sweeper.direction=[minimize,maximize]"]
    proc = _sweep(args, tmp_path / "sweep", hydra_optuna)
    assert proc.returncode == 0, proc.stderr[-3000:]
    front = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())["solutions"]
    results = [r["metrics"] for _, r in _jobs(tmp_path / "sweep")]
    assert front and all([s["values"][0], s["values"][1]] in [[m["eval_loss"], m["accuracy"]] for m in results]
                         for s in front)


@pytest.mark.parametrize("args,says", [
    (["task=a", "objective=eval_loss"], "objective=eval_loss: the task returned no metric 'eval_loss'; "
                                        "it returned final_loss"),
    (["task=a", "objective=[final_loss,3]"], "objective"),
])
def test_an_objective_the_task_does_not_return_is_one_line(tmp_path, args, says):
    run = expgpu(args + ["task.max_steps=5"], tmp_path / "run")
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: error: ") and says in last and "Traceback" not in run.stderr, last
