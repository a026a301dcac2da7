"""`python -m expgpu.report DIR` on real sweep dirs, including broken and missing jobs."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, clean_env

pytestmark = pytest.mark.timeout(240)


def report(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expgpu.report", str(path), *args], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory) -> Path:
    """A real two-job sweep with Hydra's basic launcher (jobs one after the other, in-process)."""
    sweep = tmp_path_factory.mktemp("report") / "sweep"
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", "task=a,b", "task.max_steps=20", "task.log_every=5",
                           f"hydra.sweep.dir={sweep}"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stderr
    return sweep


def rows_of(csv_path: Path) -> list[dict]:
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


def test_one_row_per_job_csv_and_loss_curves(basic_sweep, tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(basic_sweep, sweep)
    done = report(sweep)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:7] == ["job", "status", "devices", "steps", "final_loss", "accuracy", "wall_s"]
    assert lines[1].split()[:4] == ["0", "finished", "cpu", "20"]
    assert "task=a task.max_steps=20 task.log_every=5" in lines[1]
    rows = rows_of(sweep / "report.csv")
    assert [(r["job"], r["task"], r["status"]) for r in rows] == [("0", "a", "finished"), ("1", "b", "finished")]
    for r, n in zip(rows, (0, 1)):
        result = json.loads((sweep / str(n) / "result.json").read_text())
        assert float(r["final_loss"]) == result["metrics"]["final_loss"]
        assert float(r["wall_s"]) > 0
    assert rows[1]["accuracy"] != "" and rows[0]["accuracy"] == ""   # task b classifies, a regresses
    png = (sweep / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    import matplotlib.image

    assert matplotlib.image.imread(sweep / "loss_curves.png").shape[1] >= 800


def test_broken_and_missing_job_dirs_are_listed_not_fatal(basic_sweep, tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(basic_sweep, sweep)
    # Job 3 crashed while writing (torn result.json, a bad metrics line); job 2 left nothing at all.
    shutil.copytree(sweep / "1", sweep / "3")
    (sweep / "3" / "result.json").write_text('{"status": "fini')
    with open(sweep / "3" / "metrics.jsonl", "a") as f:
        f.write('{"step": 25, "lo\n')
    # Job 4: a rank failed (expgpu wrote its failure) before any result.
    (sweep / "4" / ".expgpu").mkdir(parents=True)
    (sweep / "4" / ".hydra").mkdir()
    (sweep / "4" / ".expgpu" / "rank1.failure.json").write_text(json.dumps(
        {"rank": 1, "message": "RuntimeError: CUDA out of memory", "user_error": False}))
    done = report(sweep)
    assert done.returncode == 0, done.stderr
    status = {r["job"]: (r["status"], r["error"]) for r in rows_of(sweep / "report.csv")}
    assert status["0"][0] == status["1"][0] == "finished"
    assert status["2"] == ("missing", "no job dir")
    assert status["3"][0] == "broken" and "result.json unreadable" in status["3"][1]
    assert status["4"] == ("failed", "RuntimeError: CUDA out of memory")
    assert "job 4: RuntimeError: CUDA out of memory" in done.stdout
    assert (sweep / "loss_curves.png").exists()   # the broken job's curve is still drawn


def test_a_single_run_dir_and_bad_arguments(basic_sweep, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(basic_sweep / "0", run)
    done = report(run, "--no-plot")
    assert done.returncode == 0, done.stderr
    assert [r["status"] for r in rows_of(run / "report.csv")] == ["finished"]
    assert not (run / "loss_curves.png").exists()

    missing = report(tmp_path / "nope")
    assert missing.returncode == 2
    assert missing.stderr.strip() == (f"expgpu.report: error: {tmp_path / 'nope'}: no such directory; "
                                      "give a sweep dir such as outputs/multirun/DATE/TIME")
    (tmp_path / "empty").mkdir()
    empty = report(tmp_path / "empty")
    assert empty.returncode == 2 and "no job dirs in it" in empty.stderr and "Traceback" not in empty.stderr
