"""hydra/sweeper=expgpu_optuna on the real local SLURM cluster (scripts/slurm-local): one SLURM job per
trial, submitted when a slot frees, each reporting to the journal file in the sweep dir from its own
job; an odd trial is pruned there (tests/helpers/tune_probe.py)."""

from __future__ import annotations

import json

import pytest
from slurm_cluster import slurm_cluster  # noqa: F401
from test_tune import PROBE, THRESHOLD, _states_in_journal

from conftest import HELPERS, multirun, pythonpath

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(300)
def test_trials_are_slurm_jobs_that_report_to_the_journal_and_are_pruned(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    env = {**slurm_cluster.env, "PYTHONPATH": pythonpath(HELPERS)}
    proc = multirun(PROBE + [THRESHOLD, "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0",
                             "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=5", "hydra.sweeper.n_jobs=2",
                             "hydra.sweeper.n_trials=3", "task.max_steps=30", "task.step_s=0.05"],
                    sweep, env, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _states_in_journal(sweep) == {0: "COMPLETE", 1: "PRUNED", 2: "COMPLETE"}
    pruned = json.loads((sweep / "1" / "result.json").read_text())
    assert (pruned["source"], pruned["status"], pruned["stop_signal"]) == ("slurm", "pruned", "PRUNED")
    assert pruned["steps"] < 30
    assert (proc.stdout + proc.stderr).count("-> slurm job") == 3   # one job per trial
