"""A rerun of a gpu_pool sweep in the same sweep dir (what a requeued slurm_pool allocation does, or a user's
hydra.sweep.dir=...): jobs whose dir holds their task's finished run are kept without a process; the others run
(and resume from their checkpoints); checkpoint.resume=false trains every job again. Real CLI, real processes,
simulated GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GPUS = "inventory.simulate=[{name:A100,memory_mb:40960},{name:A100,memory_mb:40960}]"


def _sweep(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expgpu", "-m", "hydra/launcher=gpu_pool", "task=a", "logger=none",
                           "task.log_every=5", GPUS, *overrides, f"hydra.sweep.dir={tmp / 'sweep'}"], cwd=tmp,
                          env=clean_env(EXPGPU_LEASE_DIR=str(tmp / "leases")), capture_output=True, text=True,
                          timeout=200)


def _jobs(tmp: Path) -> list[tuple]:
    return [(j["num"], j["state"], j["kept"]) for j in json.loads((tmp / "sweep" / "pool.json").read_text())["jobs"]]


def _stamps(tmp: Path, nums) -> dict:
    return {n: (tmp / "sweep" / str(n) / "result.json").stat().st_mtime_ns for n in nums}


def test_a_rerun_keeps_the_finished_jobs_and_runs_the_rest(tmp_path):
    first = _sweep(tmp_path, "task.max_steps=20", "task.seed=0,1")
    assert first.returncode == 0, first.stderr[-3000:]
    before = _stamps(tmp_path, (0, 1))
    again = _sweep(tmp_path, "task.max_steps=20", "task.seed=0,1,2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "gpu_pool: 2 job(s) finished in an earlier run of this sweep dir, kept (not started again): #0 #1" \
        in again.stdout, again.stdout[-3000:]
    assert _jobs(tmp_path) == [(0, "finished", True), (1, "finished", True), (2, "finished", False)]
    assert _stamps(tmp_path, (0, 1)) == before, "a kept job's run dir is left as it was"
    assert "(3 jobs)" in again.stdout   # the sweep report counts the kept jobs' results


def test_changed_task_settings_or_resume_false_run_the_jobs_again(tmp_path):
    assert _sweep(tmp_path, "task.max_steps=20", "task.seed=0,1").returncode == 0
    longer = _sweep(tmp_path, "task.max_steps=30", "task.seed=0,1")   # trains on from step 20
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert _jobs(tmp_path) == [(0, "finished", False), (1, "finished", False)]
    assert json.loads((tmp_path / "sweep" / "0" / "result.json").read_text())["resumed_from_step"] == 20
    before = _stamps(tmp_path, (0, 1))
    fresh = _sweep(tmp_path, "task.max_steps=30", "task.seed=0,1", "checkpoint.resume=false")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert _jobs(tmp_path) == [(0, "finished", False), (1, "finished", False)]
    assert _stamps(tmp_path, (0, 1)) != before


def test_a_job_past_its_time_limit_fails_saved_and_a_rerun_resumes_it(tmp_path):
    # job 1's steps take 64 ms (paced as a GPU's would): 400 of them outlast the 15 s limit on any machine
    args = ["task.max_steps=20,400", "faults.device_ms_per_example=1.0", "hydra.launcher.cpu_slots=2"]
    first = _sweep(tmp_path, *args, "hydra.launcher.timeout_min=0.25")
    assert first.returncode == 1, first.stderr[-3000:]
    out = first.stdout + first.stderr
    [line] = [ln for ln in out.splitlines() if "job #1 (" in ln and " failed: " in ln]   # the summary's line
    assert "failed: ran past hydra.launcher.timeout_min=0.25 (15 s)" in line and "checkpoint saved" in line, out
    assert "Traceback" not in first.stderr
    pool = {j["num"]: j for j in json.loads((tmp_path / "sweep" / "pool.json").read_text())["jobs"]}
    assert pool[0]["state"] == "finished" and pool[1]["state"] == "failed"
    assert 15 <= pool[1]["wall_s"] < 15 + 10, pool[1]   # SIGTERM at the limit: it saved and ended at once
    cut = json.loads((tmp_path / "sweep" / "1" / "result.json").read_text())
    assert cut["status"] == "stopped" and 0 < cut["steps"] < 400, cut
    assert (tmp_path / "sweep" / "1" / "checkpoint.pt").exists()

    again = _sweep(tmp_path, *args)   # no limit now: job 0 is kept, job 1 trains on from its checkpoint
    assert again.returncode == 0, again.stderr[-3000:]
    assert _jobs(tmp_path) == [(0, "finished", True), (1, "finished", False)]
    done = json.loads((tmp_path / "sweep" / "1" / "result.json").read_text())
    assert done["resumed_from_step"] == cut["steps"] and done["steps"] == 400, done
