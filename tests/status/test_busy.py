"""One live run per run dir, one live sweep per sweep dir (expgpu.status.busy): a second run (sweep) started in
the dir of one still in progress on this host is refused in one line, exit 2, and leaves the live one's files as
they were; once that one has ended, the same command runs (a rerun resumes, as always). Real runs and sweeps,
and synthetic process records for what only another host or a reused pid would leave."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env, cpu_env, expgpu, finish, multirun, start, wait_for_progress, wait_until

pytestmark = pytest.mark.timeout(300)


def _files(where: Path) -> dict[str, bytes]:
    """Every file under `where` that the run or sweep in progress keeps (what a second one must not touch)."""
    return {str(p.relative_to(where)): p.read_bytes() for p in sorted(where.rglob("*"))
            if p.is_file() and p.suffix in (".yaml", ".json") and "pool" not in p.name}


def test_a_second_run_in_a_live_runs_dir_is_refused_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    args = ["task=a", "task.max_steps=100000", "task.log_every=5", "faults.device_ms_per_example=0.5"]
    env = cpu_env()
    proc = start(args, run_dir, env)
    try:
        wait_for_progress(proc, run_dir)
        before = _files(run_dir)
        second = expgpu([*args, "task.optimizer.lr=0.5"], run_dir, env)
        assert second.returncode == 2, second.stderr
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith(f"expgpu: error: {run_dir}: a run is in progress there (pid {proc.pid} on ")
        assert "another hydra.run.dir (a sweep job: hydra.sweep.subdir" in line and "Traceback" not in second.stderr
        # its config, the process record, no failure record: the live run's files as they were
        assert _files(run_dir) == before and not (run_dir / ".expgpu" / "failure.json").exists()
        dry = expgpu([*args, "dry_run=true"], run_dir, env)
        assert dry.returncode == 2 and "a run is in progress there" in dry.stderr
    finally:
        os.killpg(proc.pid, signal.SIGINT)   # stops and saves
    stopped = finish(proc, run_dir)
    assert stopped.returncode == 130, stopped.stderr
    again = expgpu([*args, "dry_run=true"], run_dir, env)   # gone, the same command runs there
    assert again.returncode == 0, again.stderr


def test_a_second_sweep_in_a_live_sweeps_dir_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    env = cpu_env()   # both jobs at once on the CPU slots (a GPU node's one GPU would run them in turn)
    args = ["hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2", "task=a", "task.max_steps=100000",
            "faults.device_ms_per_example=0.5", "task.seed=0,1"]
    first = subprocess.Popen([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep}"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        wait_until("both jobs' progress", lambda: all((sweep / job / "metrics.jsonl").exists() for job in "01"),
                   timeout=90)
        before = _files(sweep)
        second = multirun(args, sweep, env)
        assert second.returncode == 2, second.stderr
        assert f"expgpu: error: {sweep}: a sweep is in progress there (pid {first.pid} on " in second.stderr
        assert "another hydra.sweep.dir" in second.stderr
        assert _files(sweep) == before
    finally:
        os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=120)
    again = multirun([*args, "dry_run=true"], sweep, env)   # gone, the same command runs there
    assert again.returncode == 0, again.stderr


def test_two_jobs_a_sweep_gives_one_dir_cannot_both_run_there(tmp_path):
    """A subdir pattern that gives two jobs one dir, on a pool that starts both at once: one trains there, the
    other is refused (its claim and the first's cannot both pass: expgpu.status.busy.claim)."""
    sweep = tmp_path / "sweep"
    # Both on CPU slots, on a GPU node too (cpu_env): there a job on the GPU claims the dir only after CUDA's
    # start (seconds), and the CPU slot's job may have finished by then, which leaves nothing to refuse.
    done = multirun(["hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2", "task=a", "task.max_steps=2000",
                     "task.seed=0,1", "hydra.sweep.subdir=same"], sweep, cpu_env())
    assert done.returncode == 2, done.stderr   # a job's user error: the sweep's code
    pool = json.loads((sweep / "pool.json").read_text())
    assert sorted(j["state"] for j in pool["jobs"]) == ["failed", "finished"], pool["jobs"]
    failed = next(j for j in pool["jobs"] if j["state"] == "failed")
    assert f"RunDirBusy: {sweep}/same: a run is in progress there" in failed["error"]
    assert "hydra.sweep.subdir, each job its own" in failed["error"]
    assert json.loads((sweep / "same" / "result.json").read_text())["status"] == "finished"


def _record(run_dir: Path, **record) -> None:
    (run_dir / ".expgpu").mkdir(parents=True, exist_ok=True)
    (run_dir / ".expgpu" / "process.json").write_text(json.dumps(record))


def test_only_a_live_process_on_this_host_refuses(tmp_path):
    import psutil

    from expgpu.errors import RunDirBusy
    from expgpu.status.busy import refuse_busy

    host = socket.gethostname()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = psutil.Process(other.pid).create_time()
        cases = {
            "live": dict(pid=other.pid, host=host, created=created),
            "reused pid": dict(pid=other.pid, host=host, created=created - 100),   # another process had it
            "another host": dict(pid=other.pid, host=host + "-not", created=created),
            "this process": dict(pid=os.getpid(), host=host, created=psutil.Process().create_time()),
        }
        for name, record in cases.items():
            _record(tmp_path / name, **record)
        with pytest.raises(RunDirBusy, match=f"a run is in progress there \\(pid {other.pid} on {host},"):
            refuse_busy(tmp_path / "live")
        for name in ("reused pid", "another host", "this process"):
            refuse_busy(tmp_path / name)
        refuse_busy(tmp_path / "no record")
    finally:
        other.kill()
        other.wait()
    refuse_busy(tmp_path / "live")   # its process is gone now


def test_a_run_or_sweep_dir_that_cannot_be_made_is_one_line(tmp_path):
    """Hydra makes the dir and dies in a traceback where it cannot (a file on its path; likewise no permission,
    a read-only file system): the guard makes it first."""
    (tmp_path / "file").write_text("")
    where = tmp_path / "file" / "x"
    run = expgpu(["task=a", "task.max_steps=5"], where)
    sweep = multirun(["task=a", "task.max_steps=5,6", "hydra/launcher=gpu_pool"], where, clean_env())
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "outputs").write_text("")   # the default run dir, outputs/DATE/TIME, cannot be claimed
    default = subprocess.run([sys.executable, "-m", "expgpu", "task=a", "task.max_steps=5"], cwd=cwd,
                             env=clean_env(), capture_output=True, text=True, timeout=120)
    for done, key in ((run, "hydra.run.dir"), (sweep, "hydra.sweep.dir"), (default, "hydra.run.dir")):
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines() == [done.stderr.strip().splitlines()[-1]], done.stderr
        assert done.stderr.startswith(f"expgpu: error: {key}"), done.stderr
        assert "Not a directory" in done.stderr, done.stderr
