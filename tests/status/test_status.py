"""`expgpu status [DIR]` on real run dirs (a run, a gpu_pool sweep, a run still training, then killed) and on
synthetic ones for what a real run cannot be made to leave cheaply (torn files, a run lost on another host, SLURM
jobs queued): the status a user would see, step of total and ETA, the sweep as one row and its jobs, --json,
--watch, and bad input as one line with exit code 2."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (
    REPO,
    clean_env,
    cpu_env,
    expgpu,
    left_early,
    multirun,
    start,
    wait_for_progress,
    wait_until,
    write_job,
)
from expgpu.status.table import number

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("test_status")]


def status(*args: str, cwd: Path = REPO, env: dict | None = None, via_main: bool = False,
           timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m expgpu.status ARGS`, or `expgpu status ARGS` as the console script calls expgpu.__main__."""
    cmd = ([sys.executable, "-c", "import sys; from expgpu.__main__ import main; sys.argv[0] = 'expgpu'; main()",
            "status", *args] if via_main else [sys.executable, "-m", "expgpu.status", *args])
    return subprocess.run(cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def rows_of(*args: str, **kw) -> list[dict]:
    done = status(*args, "--json", **kw)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def by_dir(rows: list[dict]) -> dict[str, dict]:
    return {Path(r["dir"]).name: r for r in rows}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    """outputs/ as a user's: one finished run, and a gpu_pool sweep of two jobs on CPU slots."""
    top = tmp_path_factory.mktemp("status") / "outputs"
    run = expgpu(["task=a", "task.max_steps=20"], top / "2025-01-01" / "10-00-00", env=cpu_env())
    assert run.returncode == 0, run.stderr
    sweep = top / "multirun" / "2025-01-01" / "11-00-00"
    done = multirun(["hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2", "task=a", "task.max_steps=20",
                     "task.seed=0,1"], sweep, cpu_env())
    assert done.returncode == 0, done.stderr
    return top


def test_runs_and_sweeps_newest_first(outputs):
    done = status(cwd=outputs.parent, via_main=True)   # `expgpu status`: outputs/ by default
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["STATUS", "STEP", "METRICS", "GPUS", "ELAPSED", "ETA", "DIR"]
    # the sweep, started after the run, first; one row, its jobs counted, and its best job's value by the
    # sweep report's rule (its report.csv): the training loss both jobs returned, the lower
    sweep = outputs / "multirun" / "2025-01-01" / "11-00-00"
    best = min(json.loads((sweep / job / "result.json").read_text())["metrics"]["final_loss"] for job in "01")
    assert lines[1].split()[:9] == ["sweep:", "finished", "2", "jobs", "2", "finished;", "best", "final_loss",
                                    number(best)]
    assert lines[1].endswith("outputs/multirun/2025-01-01/11-00-00")
    assert lines[2].split()[:3] == ["finished", "20/20", "(100"]
    assert "final_loss" in lines[2] and lines[2].endswith("outputs/2025-01-01/10-00-00")
    assert len(lines) == 3

    rows = rows_of(str(outputs))
    assert [r["kind"] for r in rows] == ["sweep", "run"]
    assert rows[0]["jobs"] == {"finished": 2} and rows[0]["status"] == "finished"
    assert rows[0]["metrics"] == {"final_loss": best}
    run = rows[1]
    assert (run["status"], run["step"], run["max_steps"], run["gpus"]) == ("finished", 20, 20, "cpu")
    assert run["pid"] and run["host"] == socket.gethostname() and run["elapsed_s"] > 0
    assert Path(run["dir"]) == outputs / "2025-01-01" / "10-00-00"


def test_a_sweep_dir_shows_its_jobs(outputs):
    sweep = outputs / "multirun" / "2025-01-01" / "11-00-00"
    rows = rows_of(str(sweep))
    assert sorted(Path(r["dir"]).name for r in rows) == ["0", "1"]
    assert all(r["kind"] == "job" and r["status"] == "finished" and r["step"] == 20 for r in rows)
    text = status(str(sweep), via_main=True).stdout
    assert text.count("finished") == 2 and "sweep:" not in text
    # the best job, by the sweep report's ranking, says so under the table
    best = min(rows, key=lambda r: r["metrics"]["final_loss"])
    assert [r["note"] for r in rows if r is not best] == [""]
    assert best["note"] == f"the sweep's best so far: final_loss {number(best['metrics']['final_loss'])}"
    assert f"/{Path(best['dir']).name}: {best['note']}" in text
    # a run dir alone: its one row
    assert [r["status"] for r in rows_of(str(outputs / "2025-01-01" / "10-00-00"))] == ["finished"]


def test_a_running_run_then_killed_is_lost(tmp_path):
    run_dir = tmp_path / "outputs" / "2025-01-02" / "09-00-00"
    # its ranks in its own process group (no warm server's), so that one SIGKILL ends them all
    proc = start(["task=a", "task.max_steps=100000", "task.log_every=5", "faults.device_ms_per_example=0.5"],
                 run_dir, env=cpu_env(EXPGPU_WARM_SERVER=""))
    try:
        wait_for_progress(proc, run_dir)

        def running_with_eta():
            row = rows_of(str(tmp_path / "outputs"))[0]
            return row if row["status"] == "running" and row["eta_s"] is not None else None

        row = wait_until("a running row with its ETA", running_with_eta, timeout=60, every=0.5)
        assert row["max_steps"] == 100000 and 0 < row["step"] < 100000 and row["eta_s"] > 0
        assert row["pid"] == proc.pid and row["elapsed_s"] > 0
        line = status(str(tmp_path / "outputs")).stdout.splitlines()[1]
        assert line.startswith("running") and "/100000 (" in line and "loss" in line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    row = rows_of(str(tmp_path / "outputs"))[0]
    assert row["status"] == "lost" and row["eta_s"] is None
    assert "is gone, without a result.json" in row["note"]
    assert f"{run_dir.name}: its process ({proc.pid}) is gone" in status(str(tmp_path / "outputs")).stdout


def test_a_sweeps_row_shows_its_best_by_the_reports_ranking_once_a_job_has_the_metric(tmp_path):
    """Grid sweeps too: the report marks the best job in its report.csv (as jobs end, while it is live)."""
    from expgpu import report
    from expgpu.report.collect import collect
    from expgpu.status.sweeps import rows

    def reported(sweep: Path) -> dict:
        ranked = collect(sweep)
        report.write(sweep, ranked, report.rank(ranked), plot=False)
        [row] = rows(sweep.parent, expand=False)
        return row.metrics

    sweep = tmp_path / "grid"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("{}\n")
    write_job(sweep / "0", ["lr=0.1"], {}, status="running")   # nothing returned yet: no best
    assert reported(sweep) == {}
    write_job(sweep / "0", ["lr=0.1"], {"accuracy": 0.91, "final_loss": 0.2})
    write_job(sweep / "1", ["lr=0.01"], {"accuracy": 0.95, "final_loss": 0.3})
    assert reported(sweep) == {"accuracy": 0.95}   # a score: higher is better, as the report ranks it
    notes = {Path(r.dir).name: r.note for r in rows(sweep)}   # the sweep's own listing: its best job says so
    assert notes == {"0": "", "1": "the sweep's best so far: accuracy 0.95"}
    (sweep / report.CSV_FILE).write_text("not,the,report\n")
    assert rows(tmp_path, expand=False)[0].metrics == {}
    # A search's best is its study's: the best complete trial's value, and its job
    def study(objective: list[str], directions: list[str]) -> None:
        trials = [{"job_dir": str(sweep / job), "state": "COMPLETE", "values": [value]}
                  for job, value in (("0", 0.2), ("1", 0.3))]
        (sweep / "study.json").write_text(json.dumps(
            {"objective": objective, "directions": directions, "trials": trials}))

    study(["final_loss"], ["minimize"])
    assert reported(sweep) == {"final_loss": 0.2}
    assert {Path(r.dir).name: r.note for r in rows(sweep)}["0"] == "the sweep's best so far: final_loss 0.2"
    # ... and one of two objectives has no single best, whatever the report ranks by
    study(["accuracy", "final_loss"], ["maximize", "minimize"])
    assert reported(sweep) == {} and not any(r.note for r in rows(sweep))


# Synthetic run dirs: what a kill mid-write, another host or SLURM's queue leave


def write_run(run_dir: Path, rows: list[dict] | None = None, result: dict | None = None,
              record: dict | None = None, metrics_tail: str = "") -> Path:
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".expgpu").mkdir(exist_ok=True)
    if rows is not None:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + metrics_tail)
    if result is not None:
        (run_dir / "result.json").write_text(json.dumps(result))
    if record is not None:
        (run_dir / ".expgpu" / "process.json").write_text(json.dumps(record))
    return run_dir


def old(path: Path, seconds: float = 3600) -> None:
    """Files not touched for `seconds`: news that stopped coming."""
    t = time.time() - seconds
    for p in [*path.rglob("*"), path]:
        os.utime(p, (t, t))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_torn_files_and_lost_runs_are_rows(tmp_path):
    now = time.time()
    rows = [{"step": s, "loss": 1.0 / s, "max_steps": 100, "eta_s": 10.0, "time": now} for s in range(1, 51)]
    write_run(tmp_path / "torn_result", rows, record={"host": socket.gethostname(), "pid": dead_pid()})
    (tmp_path / "torn_result" / "result.json").write_text('{"status": "fini')
    write_run(tmp_path / "torn_metrics", rows, result={"status": "finished", "steps": 50, "metrics": {"loss": 0.02}},
              metrics_tail='{"step": 51, "lo')
    me = {"host": socket.gethostname(), "pid": os.getpid(), "created": __import__("psutil").Process().create_time(),
          "started": now - 60}
    write_run(tmp_path / "alive_here", rows, record=me)
    write_run(tmp_path / "reused_pid", rows, record={**me, "created": me["created"] - 1000})
    write_run(tmp_path / "other_host_fresh", rows, record={"host": "gpu-elsewhere", "pid": 1, "started": now - 60})
    old(write_run(tmp_path / "other_host_stale", rows, record={"host": "gpu-elsewhere", "pid": 1,
                                                               "started": now - 7200}))
    failed = write_run(tmp_path / "failed_no_result", rows, record={"host": socket.gethostname(), "pid": dead_pid()})
    (failed / ".expgpu" / "failure.json").write_text(json.dumps({"message": "ValueError: bad batch"}))
    failed_alive = write_run(tmp_path / "failed_alive", rows, record=me)   # its process ran on: a sweep's next job
    (failed_alive / ".expgpu" / "failure.json").write_text(json.dumps({"message": "RuntimeError: boom"}))
    done = status(str(tmp_path))
    assert done.returncode == 0, done.stderr
    got = by_dir(rows_of(str(tmp_path)))
    assert got["failed_alive"]["status"] == "failed" and got["failed_alive"]["note"] == "RuntimeError: boom"
    assert got["torn_result"]["status"] == "broken" and "result.json unreadable" in got["torn_result"]["note"]
    assert got["torn_metrics"]["status"] == "finished" and got["torn_metrics"]["step"] == 50
    assert "last line is torn" in got["torn_metrics"]["note"]
    assert got["alive_here"]["status"] == "running" and got["alive_here"]["step"] == 50
    assert got["alive_here"]["max_steps"] == 100 and 0 <= got["alive_here"]["eta_s"] <= 10
    assert got["alive_here"]["metrics"] == {"loss": 0.02}
    assert got["reused_pid"]["status"] == "lost"   # the pid lives, but it is another process
    assert got["other_host_fresh"]["status"] == "running"
    assert got["other_host_stale"]["status"] == "lost" and "gpu-elsewhere" in got["other_host_stale"]["note"]
    assert got["failed_no_result"]["status"] == "failed" and got["failed_no_result"]["note"] == "ValueError: bad batch"
    assert "torn_result: result.json unreadable" in done.stdout and "50/100 (50 %)" in done.stdout


def test_a_running_run_that_waits_for_its_data_says_so(tmp_path):
    now = time.time()
    me = {"host": socket.gethostname(), "pid": os.getpid(), "created": __import__("psutil").Process().create_time(),
          "started": now - 60}
    rows = [{"step": s, "loss": 0.5, "max_steps": 100, "eta_s": 10.0, "time": now, "data_wait": 0.62}
            for s in range(1, 11)]
    write_run(tmp_path / "starved", rows, record=me)
    write_run(tmp_path / "fed", [{**r, "data_wait": 0.03} for r in rows], record=me)
    got = by_dir(rows_of(str(tmp_path)))
    assert got["starved"]["data_wait"] == 0.62 and got["fed"]["data_wait"] == 0.03
    assert got["starved"]["note"] == ("waited for batches 62% of its last 30 s: the data, not the model, sets its "
                                      "pace") and got["fed"]["note"] == ""
    assert "starved: waited for batches 62% of its last 30 s" in status(str(tmp_path)).stdout


def test_read_only_the_tail_of_a_long_metrics_file(tmp_path):
    from expgpu.status import read_run

    row = {"step": 0, "loss": 0.5, "note": "x" * 200}
    path = write_run(tmp_path / "long", [])
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(100_000):   # ~25 MB
            row["step"] = s
            f.write(json.dumps(row) + "\n")
    read_before = _bytes_read()
    got = read_run(path)
    assert _bytes_read() - read_before < 1_000_000   # its tail, not its 25 MB (a count, not a time: load-proof)
    assert got.step == 99_999


def _bytes_read() -> int:
    """The bytes this process has read so far, through any read call (the kernel's count)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def fake_squeue(tmp_path: Path, answer: str) -> dict:
    """An env whose PATH has a squeue that prints `answer` and logs how it was called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'squeue.calls'}\nprintf '{answer}'\n")
    (bin_dir / "squeue").chmod(0o755)
    return clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}")


def test_slurm_jobs_not_started_are_queued(tmp_path):
    top = tmp_path / "outputs"
    # a requeued job's run dir: its record is from its last node, which is gone quiet
    old(write_run(top / "slurm" / "1234", [{"step": 5}], record={"host": "gpu-01", "pid": 7, "job": "1234"}))
    old(write_run(top / "slurm" / "1240", [{"step": 5}]))   # no longer in the queue: lost
    sweep = top / "multirun" / "2025-01-01" / "12-00-00"
    write_run(sweep / "0", [{"step": 3}], result={"status": "finished", "steps": 3})
    write_run(sweep / "1", [])   # a gpu_pool job primed ahead (its .hydra/), its GPUs still busy
    (sweep / "pool.json").write_text(json.dumps({"jobs": [{"num": 1, "dir": str(sweep / "1"), "state": "queued"},
                                                           {"num": 2, "dir": str(sweep / "2"), "state": "queued"}]}))
    for job in ("2000_0", "2000_1"):
        (sweep / ".submitit" / job).mkdir(parents=True)
    env = fake_squeue(tmp_path, "1234|PENDING\\n2000_1|PENDING\\n")
    got = rows_of(str(top), env=env)
    assert (tmp_path / "squeue.calls").read_text().count("\n") == 1   # asked once, for every job
    assert set((tmp_path / "squeue.calls").read_text().split()[-1].split(",")) == {"1234", "1240", "2000_0",
                                                                                    "2000_1"}
    runs = by_dir(got)
    assert runs["1234"]["status"] == "queued" and runs["1240"]["status"] == "lost"
    assert runs["12-00-00"]["jobs"] == {"finished": 1, "queued": 1, "waiting": 2}
    assert runs["12-00-00"]["status"] == "queued"
    jobs = by_dir(rows_of(str(sweep), env=env))
    assert jobs["2000_1"]["status"] == "queued" and jobs["0"]["status"] == "finished" and "2000_0" not in jobs
    assert jobs["1"]["status"] == jobs["2"]["status"] == "waiting"
    # without squeue: the files' word, and no failure
    bare = clean_env(PATH=os.path.dirname(sys.executable))
    runs = by_dir(rows_of(str(top), env=bare))
    assert runs["1234"]["status"] == "lost"
    assert runs["12-00-00"]["jobs"] == {"finished": 1, "submitted": 2, "waiting": 2}


def test_a_pool_sweeps_waiting_jobs_say_why_they_wait(tmp_path):
    sweep = tmp_path / "outputs" / "multirun" / "2025-01-01" / "12-00-00"
    write_run(sweep / "0", [{"step": 3}], result={"status": "finished", "steps": 3})
    why = "waiting for GPUs in use outside expgpu (GPU 0: 1 process outside expgpu (pid 4242 python))"
    (sweep / "pool.json").write_text(json.dumps({"waiting": why, "jobs": [
        {"num": 0, "dir": str(sweep / "0"), "state": "finished"},
        {"num": 1, "dir": str(sweep / "1"), "state": "queued"},
        {"num": 2, "dir": str(sweep / "2"), "state": "queued"}]}))
    env = clean_env(PATH=os.path.dirname(sys.executable))
    runs = by_dir(rows_of(str(tmp_path / "outputs"), env=env))
    assert runs["12-00-00"]["note"] == why   # the sweep's row
    jobs = by_dir(rows_of(str(sweep), env=env))
    assert (jobs["1"]["status"], jobs["1"]["note"]) == ("waiting", why) and jobs["2"]["note"] == ""   # said once
    shown = status(str(sweep), env=env).stdout
    assert shown.count(why) == 1, shown


def test_a_sweep_that_ended_before_any_job_says_why(tmp_path):
    top = tmp_path / "outputs"
    refused = top / "multirun" / "2025-01-01" / "13-00-00"
    done = multirun(["hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=0", "task=a"], refused, cpu_env())
    assert done.returncode == 2, done.stderr
    line = "hydra.launcher.cpu_slots=0 is not allowed: an integer >= 1"
    assert done.stderr.strip().splitlines()[-1] == f"expgpu: error: {line}"
    # gone without a word (killed before its first job), and one that is starting now
    gone, starting = top / "multirun" / "2025-01-01" / "12-00-00", top / "multirun" / "2025-01-01" / "14-00-00"
    pid = dead_pid()
    for sweep, record in ((gone, {"pid": pid, "host": socket.gethostname(), "created": 0.0}),
                          (starting, {"pid": os.getpid(), "host": socket.gethostname(),
                                      "created": psutil.Process().create_time()})):
        (sweep / ".expgpu").mkdir(parents=True)
        (sweep / "multirun.yaml").write_text("hydra: {}\n")
        (sweep / ".expgpu" / "process.json").write_text(json.dumps(record))
    runs = by_dir(rows_of(str(top)))
    assert (runs["13-00-00"]["status"], runs["13-00-00"]["note"]) == ("failed", line)
    assert (runs["12-00-00"]["status"], runs["12-00-00"]["note"]) == (
        "lost", f"its process ({pid}) ended before any job started")
    assert (runs["14-00-00"]["status"], runs["14-00-00"]["note"]) == ("starting", "")
    # the same sweep run again, right: the earlier attempt's line is not this one's
    done = multirun(["hydra/launcher=gpu_pool", "task=a", "task.max_steps=3"], refused, cpu_env())
    assert done.returncode == 0, done.stderr
    assert by_dir(rows_of(str(top)))["13-00-00"]["status"] == "finished"


@pytest.mark.parametrize("what", ["missing", "empty", "file"])
def test_bad_dir_is_one_line_exit_2(tmp_path, what):
    target = tmp_path / "nothing"
    if what == "empty":
        (target / "sub").mkdir(parents=True)
    elif what == "file":
        target.write_text("x")
    for via_main in (False, True):
        done = status(str(target), via_main=via_main)
        assert done.returncode == 2 and done.stdout == ""
        assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
        assert done.stderr.startswith(f"expgpu status: error: {target}: ")
    assert status("--watch", "0", str(target)).returncode == 2


def test_a_reader_that_leaves_early_ends_it_quietly(tmp_path):
    for i in range(700):   # ~100 bytes a row of the table: 70 KB
        write_run(tmp_path / f"run-{i:04d}", result={"status": "finished", "steps": 10, "metrics": {"final_loss": 0.5}})
    for args in ([], ["--json"], ["--watch", "1"]):   # watching too: it stops, not loops into the void
        done = left_early([sys.executable, "-m", "expgpu.status", str(tmp_path), *args])
        assert done.returncode == 0 and done.stdout.strip() and done.stderr == "", (args, done.stderr[-2000:])


def test_watch_refreshes_until_ctrl_c(tmp_path):
    write_run(tmp_path / "r", [{"step": 1}], result={"status": "finished", "steps": 1})
    # Ctrl-C as a terminal gives it: SIGINT at its default (a test before may have left it ignored in this
    # process, and an ignored SIGINT is inherited: Python then never raises KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-m", "expgpu.status", str(tmp_path), "--watch", "0.2"], cwd=REPO,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = 0
    for line in proc.stdout:   # the Ctrl-C once it has refreshed (a loaded machine may take seconds to start it)
        seen += "STATUS" in line
        if seen >= 2:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert seen >= 2   # refreshed


def test_status_imports_no_torch(tmp_path):
    write_run(tmp_path / "r", [{"step": 1}], result={"status": "finished", "steps": 1})
    code = ("import sys; from expgpu.status import main; main([sys.argv[1]]); "
            "assert 'torch' not in sys.modules and 'omegaconf' not in sys.modules, 'heavy import'")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
