"""expgpu.warm_server (expgpu.launch.warm_server): the ranks of many launches forked from one process
that imported torch, and run as fresh ones would; a launch it cannot stand in for runs without it;
nothing outlives the launcher it belongs to. (Every other test's launches use one too: conftest.clean_env.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from conftest import HELPERS, PACED, REPO, TESTS, clean_env, expgpu, finish, start, wait_for_progress, wait_until
from expgpu.launch import warm_server

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("warm_server")]


def _serve(path: Path) -> subprocess.Popen:
    """A server of this module's own (the test kills and inspects it), started as a user would,
    once it is ready."""
    proc = subprocess.Popen([sys.executable, "-m", "expgpu.warm_server", str(path)], cwd=REPO,
                            env=clean_env(EXPGPU_WARM_SERVER=""), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    ready = proc.stderr.readline()   # bounded by the module's timeout
    assert f"ready: export EXPGPU_WARM_SERVER={path}" in ready, ready + proc.stderr.read()
    return proc


@pytest.fixture(scope="module")
def server():
    path = Path(tempfile.mkdtemp(prefix="expgpu-warm-")) / "s"
    proc = _serve(path)
    yield proc, str(path)
    proc.terminate()
    assert proc.wait(20) == 0, proc.stderr.read()
    assert not path.exists(), "the server left its socket behind"
    path.parent.rmdir()


def _processes(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("process*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_its_ranks_run_as_fresh_ones_in_the_launch_directory_and_path(tmp_path, server, nproc):
    """Forked ranks see the launch's working directory, PYTHONPATH (the probe task imports from
    it), rank variables, threads and argv, as ranks started without the server do."""
    _, path = server
    args = ["--config-dir", str(TESTS / "conf"), "task=probe_process", f"launch.nproc_per_node={nproc}"]
    seen = {}
    for mode, where in (("server", path), ("own", "")):
        env = clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_SERVER=where, EXPGPU_WARM_RANKS="1" if where else "0")
        run = expgpu(args, tmp_path / mode, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "not used for this launch" not in run.output, run.output
        seen[mode] = _processes(run.run_dir)
        assert len(seen[mode]) == nproc
    for rank, (forked, fresh) in enumerate(zip(seen["server"], seen["own"])):
        assert forked["forked_by"] == "expgpu.warm_server" and not fresh["forked"]
        assert forked["cwd"] == fresh["cwd"] == str(tmp_path)
        assert forked["path"][:2] == fresh["path"][:2] == [str(tmp_path), str(HELPERS)], (forked, fresh)
        assert forked["rank_env"] == str(rank)
        assert forked["threads"] == fresh["threads"] and forked["argv"][-1] == str(tmp_path / "server")


@pytest.mark.slow
def test_a_one_rank_launch_trains_as_without_it(tmp_path, server):
    """Its one rank is forked (the launcher only supervises it) and trains to the same losses,
    with the same console lines and result as a run in the launcher's own process."""
    _, path = server
    args = ["task=a", "task.max_steps=40", "task.log_every=10"]
    forked = expgpu(args, tmp_path / "server", env=clean_env(EXPGPU_WARM_SERVER=path))
    alone = expgpu(args, tmp_path / "alone", env=clean_env(EXPGPU_WARM_SERVER=""))
    for run in (forked, alone):
        assert run.returncode == 0, run.stderr[-3000:]
    assert [m["loss"] for m in forked.metrics()] == [m["loss"] for m in alone.metrics()]
    assert forked.result["source"] == alone.result["source"] == "single"
    assert (forked.run_dir / "logs" / "rank0.log").exists()   # the fork's: its launcher did not train
    assert not (alone.run_dir / "logs" / "rank0.log").exists()
    def steps(run) -> list[str]:   # the progress lines without their pace, which the clock decides
        return [re.sub(r"  [\d.]+ steps/s(  data \d+%)?  ETA \S+$", "", ln.split(" - ", 1)[1])
                for ln in run.stderr.splitlines() + run.stdout.splitlines() if " - step " in ln]

    lines = steps(forked)
    assert lines == steps(alone) and lines


@pytest.mark.slow
def test_a_one_rank_launch_stops_on_the_launchers_signal_and_resumes(tmp_path, server):
    """SIGTERM to the launcher (`kill PID`, SLURM's signal): passed on to the forked rank, which
    stops with a checkpoint; the launch exits 143, and the next one resumes it to the end."""
    _, path = server
    env = clean_env(EXPGPU_WARM_SERVER=path)
    args = ["task=a", "task.max_steps=600", "task.log_every=5", PACED]
    proc = start(args, tmp_path / "run", env=env)
    wait_for_progress(proc, tmp_path / "run")
    proc.send_signal(signal.SIGTERM)
    run = finish(proc, tmp_path / "run")
    assert run.returncode == 143, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1].startswith("expgpu: stopped at step "), run.stderr[-2000:]
    stopped = run.result
    assert stopped["status"] == "stopped" and 0 < stopped["steps"] < 600
    resumed = expgpu(args, tmp_path / "run", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == stopped["steps"] and resumed.result["steps"] == 600


@pytest.mark.slow
def test_a_launch_it_cannot_stand_in_for_runs_without_it_and_says_why(tmp_path, server):
    """PYTHONHASHSEED is read when an interpreter starts: a fork would keep the server's."""
    _, path = server
    env = clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_SERVER=path, PYTHONHASHSEED="7")
    run = expgpu(["--config-dir", str(TESTS / "conf"), "task=probe_process", "launch.nproc_per_node=2"],
                 tmp_path / "run", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [ln for ln in run.output.splitlines() if "not used for this launch" in ln]
    assert len(said) == 1 and "PYTHONHASHSEED='7' here, None in the server" in said[0], run.output
    assert [p["forked_by"] for p in _processes(run.run_dir)] == ["expgpu.launch.warm"] * 2   # the launch's own


@pytest.mark.slow
def test_a_gpu_pool_job_trains_its_one_rank_in_its_own_warm_process(tmp_path, server):
    """The pool's job process imported torch already: forking the rank elsewhere would gain nothing."""
    _, path = server
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", "--config-dir", str(TESTS / "conf"),
                           "task=probe_process", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=1",
                           f"hydra.sweep.dir={sweep}", "gpu_map=sequential,ranked"], cwd=REPO, capture_output=True,
                          text=True, env=clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_SERVER=path), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [p for job in ("0", "1") for p in _processes(sweep / job)]
    assert [p["forked_by"] for p in seen] == [None, None], seen


@pytest.mark.slow
def test_a_killed_launcher_takes_its_forked_rank_with_it(tmp_path, server):
    proc, path = server
    env = clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_SERVER=path)
    launcher = start(["--config-dir", str(TESTS / "conf"), "task=probe_paced", "task.step_s=0.2",
                      "task.max_steps=1000"], tmp_path / "run", env=env)
    wait_until("the rank's first step", lambda: (tmp_path / "run" / "at").exists(), 60)
    ranks = psutil.Process(proc.pid).children()
    assert len(ranks) == 1
    os.killpg(launcher.pid, signal.SIGKILL)   # no handler, no finally: the server must notice
    launcher.wait()
    wait_until("the orphaned rank's end", lambda: not ranks[0].is_running() or
               ranks[0].status() == psutil.STATUS_ZOMBIE, 10)
    again = expgpu(["task=a", "task.max_steps=5"], tmp_path / "again", env=env)   # and it serves on
    assert again.returncode == 0 and "not used" not in again.output, again.output[-2000:]


@pytest.mark.slow
def test_a_path_where_nothing_listens_is_one_line(tmp_path):
    where = tmp_path / "nothing"
    run = expgpu(["task=a", "task.max_steps=5"], tmp_path / "run", env=clean_env(EXPGPU_WARM_SERVER=str(where)))
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert f"EXPGPU_WARM_SERVER='{where}': no warm server listens there" in last, last
    assert "python -m expgpu.warm_server" in last
    # Inside a SLURM job (here a bare sbatch shell's variables) ranks stay in the job: never asked.
    in_job = expgpu(["task=a", "task.max_steps=5"], tmp_path / "job",
                    env=clean_env(EXPGPU_WARM_SERVER=str(where), SLURM_JOB_ID="7"))
    assert in_job.returncode == 0, in_job.stderr[-2000:]


@pytest.mark.slow
def test_stopping_the_server_ends_its_ranks_and_a_second_one_is_refused(tmp_path):
    path = Path(tempfile.mkdtemp(prefix="expgpu-warm-")) / "s"
    proc = _serve(path)
    try:
        second = subprocess.run([sys.executable, "-m", "expgpu.warm_server", str(path)], capture_output=True,
                                text=True, env=clean_env(EXPGPU_WARM_SERVER=""), timeout=60)
        assert second.returncode == 2 and second.stderr.strip().splitlines() == [
            f"expgpu: error: a warm server already listens on {path}: use it (EXPGPU_WARM_SERVER={path}) "
            "or stop it first"], second.stderr
        env = clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_SERVER=str(path))
        run_dir = tmp_path / "run"
        launcher = start(["--config-dir", str(TESTS / "conf"), "task=probe_paced", "task.step_s=0.2",
                          "task.max_steps=1000", "launch.nproc_per_node=2"], run_dir, env=env)
        wait_until("the ranks' first step", lambda: (run_dir / "at").exists(), 60)
        proc.terminate()
        assert proc.wait(20) == 0 and not path.exists()
        out, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 1, err[-2000:]
        assert "killed by SIGKILL" in err.strip().splitlines()[-1], err[-2000:]
    finally:
        proc.kill()
        shutil.rmtree(path.parent, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# What the server refuses (its rule, in this process)

@pytest.fixture
def started(monkeypatch, tmp_path):
    """This process as a server that started in `tmp_path` with this environment."""
    monkeypatch.setattr(warm_server, "_START_ENV", {"PATH": "/bin", "OMP_NUM_THREADS": "1"})
    monkeypatch.setattr(warm_server, "_BASE_PATH", [str(tmp_path), *sys.path[1:]])
    monkeypatch.setattr(warm_server, "_OWN_PYTHONPATH", [])
    monkeypatch.setattr(warm_server, "_STAMP", warm_server._code_stamp())
    return lambda env, cwd=str(tmp_path), python=sys.executable: warm_server.refusal(
        {"python": python, "cwd": cwd, "env": env, "argv": []})


@pytest.mark.parametrize("env, why", [
    ({"PATH": "/bin", "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "PYTHONPATH": "/x"}, None),  # a rank's own
    ({"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "EXPGPU_RANK": "3"}, None),   # read later
    ({"PATH": "/bin", "PYTHONHASHSEED": "0"}, "PYTHONHASHSEED='0' here, None in the server (read at start-up)"),
    ({"PATH": "/bin", "TORCH_LOGS": "dynamo"}, "TORCH_LOGS='dynamo' here, None in the server (read at start-up)"),
    ({"PATH": "/bin", "LD_PRELOAD": "/lib/x.so"}, "LD_PRELOAD='/lib/x.so' here, None in the server (read at start-up)"),
])
def test_it_refuses_a_launch_whose_start_up_variables_differ(started, env, why):
    assert started(env) == why


def test_it_refuses_another_interpreter_or_changed_code(started, monkeypatch):
    env = {"PATH": "/bin"}
    assert started(env, python="/usr/bin/python3") == f"it runs {sys.executable}, this launch /usr/bin/python3"
    monkeypatch.setitem(warm_server._STAMP, "expgpu", 0)
    assert started(env) == "expgpu's or torch's files changed since it started: restart it"


def test_it_refuses_a_directory_that_would_shadow_what_it_imported(started, tmp_path):
    shadowing = tmp_path / "elsewhere"
    (shadowing / "json").mkdir(parents=True)
    (shadowing / "json" / "__init__.py").write_text("")
    assert started({"PATH": "/bin"}, cwd=str(shadowing)).startswith(
        f"{shadowing / 'json'} would shadow json, which it imported from ")
    assert started({"PATH": "/bin", "PYTHONPATH": str(shadowing)}).startswith(f"{shadowing / 'json'} would shadow")
    (shadowing / "json").rename(shadowing / "my_task")   # a module of the launch's own
    assert started({"PATH": "/bin"}, cwd=str(shadowing)) is None
