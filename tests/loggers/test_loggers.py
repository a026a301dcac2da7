"""Loggers (logger=csv|tensorboard|mlflow|wandb|none) with the real packages, on real runs and sweeps.

What a user would check: each logger holds exactly the rows of metrics.jsonl (same steps, same
values); a run stopped by SIGTERM, or killed after its last checkpoint, and rerun in the same dir
continues the same logger run with every step once; a sweep gives one logger run per job, grouped
by sweep, named by the job's overrides, under the basic launcher, gpu_pool, submitit_local and joblib; a
logger whose package is missing stops the run in one line naming the pip extra.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HELPERS, PACED, REPO, TESTS, clean_env, expgpu, finish, start, wait_for_progress
from expgpu.loggers.progress import FIELDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.xdist_group("test_loggers")]

# As tests/e2e/test_resume.py: long enough that a signal after the first row lands mid-training.
STEPS = 1200
ARGS = ["task=a", f"task.max_steps={STEPS}", "task.log_every=5", "backend.timeout_s=60"]


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _history(run_dir: Path, name: str) -> list[tuple[int, float]]:
    return [(r["step"], r[name]) for r in _jsonl(run_dir) if name in r]


def _mlflow(store: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")


def _mlflow_runs(store: Path) -> list:
    client = _mlflow(store)
    experiments = client.search_experiments()
    return [r for e in experiments for r in client.search_runs([e.experiment_id])]


def _mlflow_history(store: Path, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in _mlflow(store).get_metric_history(run_id, name))


def _tensorboard(log_dir: Path, name: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})   # 0: keep every point
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(name)]


def _same_floats(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> None:
    assert [s for s, _ in a] == [s for s, _ in b], (len(a), len(b))
    assert all(abs(x - y) <= 1e-6 * max(1.0, abs(y)) for (_, x), (_, y) in zip(a, b))   # TB stores float32


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float]]:
    """The loss history of an uninterrupted run (no logger at all)."""
    return _uninterrupted(tmp_path_factory.mktemp("ref") / "run", [])


def _uninterrupted(run_dir: Path, extra: list[str]) -> list[tuple[int, float]]:
    run = expgpu(ARGS + extra + ["logger=none"], run_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (run.run_dir / "metrics.csv").exists()
    return _history(run.run_dir, "loss")


def test_the_logger_group_composes_one_or_several_or_none(tmp_path):
    def cfg(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "expgpu", "--cfg", "job", *args], cwd=REPO, env=clean_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        import yaml

        return yaml.safe_load(done.stdout)["logger"]

    assert cfg() == {"csv": {"file": "metrics.csv"}, "tensorboard": None, "mlflow": None, "wandb": None}
    both = cfg("logger=[csv,tensorboard]", "logger.tensorboard.dir=tb")
    assert both["csv"] == {"file": "metrics.csv"} and both["tensorboard"] == {"dir": "tb"} and both["mlflow"] is None
    assert set(cfg("logger=none").values()) == {None}
    assert cfg("logger=mlflow")["mlflow"] == {"tracking_uri": None, "experiment": None}

    bad = expgpu(["logger=mlfow"], tmp_path / "bad")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    line = bad.stderr.strip().splitlines()[-1]
    assert "logger" in line and "mlflow" in line and "tensorboard" in line, line   # Hydra lists the options
    wrong = expgpu(["logger=wandb", "logger.wandb.mode=sometimes"], tmp_path / "wrong")
    assert wrong.returncode == 2 and "logger.wandb.mode" in wrong.stderr and "offline" in wrong.stderr


def test_csv_holds_the_rows_of_metrics_jsonl_and_grows_columns(tmp_path):
    # task b logs loss and lr every step and evaluates every 10 steps: eval_loss and accuracy appear later.
    # logger.csv.file in a dir of its own, which the logger makes
    run = expgpu(["task=b", "task.max_steps=30", "task.log_every=5", "task.eval_every=10",
                  "logger.csv.file=csv/metrics.csv"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    with open(run.run_dir / "csv" / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        columns, rows = reader.fieldnames, list(reader)
    assert columns[0] == "step" and columns[-2:] == ["epoch", "time"]
    assert {"loss", "lr", "eval_loss", "accuracy"} <= set(columns)
    jsonl = _jsonl(run.run_dir)
    assert [int(r["step"]) for r in rows] == [r["step"] for r in jsonl]
    for got, want in zip(rows, jsonl):
        assert {k: float(v) for k, v in got.items() if v != ""} == \
            {k: float(v) for k, v in want.items() if k not in FIELDS}   # the progress stays in metrics.jsonl


def test_sigterm_then_rerun_continues_the_same_tensorboard_and_mlflow_runs(tmp_path, paced_reference):
    # paced: unpaced, the run can end before rows are seen (they reach metrics.jsonl once a second)
    reference = paced_reference
    run_dir = tmp_path / "run"
    args = ARGS + [PACED, "logger=[csv,tensorboard,mlflow]"]
    proc = start(args, run_dir)
    wait_for_progress(proc, run_dir)
    deadline = time.monotonic() + 60
    while len(_jsonl(run_dir)) < 20 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)   # some history in the loggers before the stop
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, run_dir)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "MLflow database tables" not in stopped.stderr   # a new store's schema migration, at INFO: quiet
    stopped_at = stopped.result["steps"]
    assert 100 <= stopped_at < STEPS
    first = json.loads((run_dir / ".expgpu" / "loggers.json").read_text())
    [run] = _mlflow_runs(run_dir)
    assert run.info.status == "KILLED" and run.info.run_id == first["mlflow"]["run_id"]

    resumed = expgpu(args, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == stopped_at
    assert json.loads((run_dir / ".expgpu" / "loggers.json").read_text())["mlflow"] == first["mlflow"]
    _same_floats(_history(run_dir, "loss"), reference)   # metrics.jsonl as if never stopped

    [run] = _mlflow_runs(run_dir)   # one MLflow run, not one per attempt
    assert run.info.run_id == first["mlflow"]["run_id"] and run.info.status == "FINISHED"
    _same_floats(_mlflow_history(run_dir, run.info.run_id, "loss"), reference)
    assert run.data.metrics["final_loss"] == resumed.result["metrics"]["final_loss"]
    assert run.data.params["task.max_steps"] == str(STEPS) and run.data.tags["expgpu.overrides"] == " ".join(args)

    _same_floats(_tensorboard(run_dir / "tensorboard", "loss"), reference)
    with open(run_dir / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [s for s, _ in reference]


@pytest.mark.parametrize("kind", ["exception", "kill"])
def test_a_crash_after_the_checkpoint_leaves_no_duplicate_and_no_missing_step(tmp_path, reference, kind):
    # A crash at step 253, 53 steps after the last checkpoint. An exception: the loggers were sent
    # every row up to 250, which the resume redoes (MLflow cannot take them back: they must not be
    # sent again). SIGKILL: MLflow's last batch was never sent (the resume sends what it lacks from
    # metrics.jsonl).
    run_dir = tmp_path / "run"
    args = ARGS + ["logger=[tensorboard,mlflow]", "checkpoint.every_steps=100"]
    crashed = expgpu(args + ["faults.crash_rank=0", "faults.crash_step=253", f"faults.kind={kind}"], run_dir)
    # Killed: the launcher that trained it, or the rank a warm server forked (conftest.clean_env),
    # which its launcher then reports.
    supervised = (run_dir / "logs" / "rank0.log").exists()
    assert crashed.returncode == (1 if kind == "exception" or supervised else -signal.SIGKILL), crashed.stderr[-3000:]
    last = max(s for s, _ in _history(run_dir, "loss"))
    # SIGKILL: rows reach the OS at least at each checkpoint (and every second); those after the
    # checkpoint at 200 may have died in the process's buffer: the resume redoes them anyway.
    assert last == 253 if kind == "exception" else 200 <= last <= 250, last
    if kind == "exception":
        [run] = _mlflow_runs(run_dir)
        assert run.info.status == "FAILED"
        assert max(s for s, _ in _mlflow_history(run_dir, run.info.run_id, "loss")) == 250
    resumed = expgpu(args, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == 200
    [run] = _mlflow_runs(run_dir)
    assert run.info.status == "FINISHED"
    _same_floats(_mlflow_history(run_dir, run.info.run_id, "loss"), reference)
    _same_floats(_tensorboard(run_dir / "tensorboard", "loss"), reference)


SWEEP = ["task=a,b", "task.max_steps=20", "task.log_every=5"]
LAUNCHERS = {
    "basic": [],
    "gpu_pool": ["hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2"],
    "submitit_local": ["hydra/launcher=submitit_local"],
    # each job in a loky worker process (n_jobs=1 would run them in this one)
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
}


def _sweep(args: list[str], sweep_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=280)


# SWEEP's jobs: a logger run's name (the job's overrides) -> the job's dir in the sweep dir
SWEEP_JOBS = {"task=a,task.max_steps=20,task.log_every=5": "0", "task=b,task.max_steps=20,task.log_every=5": "1"}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_sweep_is_one_mlflow_experiment_and_tensorboard_run_per_job(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    done = _sweep(SWEEP + ["logger=[tensorboard,mlflow]"] + LAUNCHERS[launcher], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_one_logger_run_per_job(sweep, SWEEP_JOBS)


def assert_one_logger_run_per_job(sweep: Path, names: dict[str, str]) -> None:
    """SWEEP's loggers: one MLflow experiment in the sweep's store with a FINISHED run per job, and a
    TensorBoard run per job, each named by the job's overrides and holding its metrics.jsonl."""
    client = _mlflow(sweep)   # the sweep's own store, in the sweep dir
    [experiment] = [e for e in client.search_experiments() if e.name != "Default"]
    assert experiment.name == str(sweep)
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(names)
    for r in runs:
        job = sweep / names[r.info.run_name]
        assert r.info.status == "FINISHED" and r.data.tags["expgpu.run_dir"] == str(job)
        result = json.loads((job / "result.json").read_text())
        assert r.data.metrics["final_loss"] == result["metrics"]["final_loss"]
        assert r.data.params["task.max_steps"] == "20"
        _same_floats(_mlflow_history(sweep, r.info.run_id, "loss"), _history(job, "loss"))

    for name, num in names.items():   # tensorboard --logdir SWEEP shows a run per job, named by its overrides
        log_dir = sweep / num / "tensorboard" / name
        _same_floats(_tensorboard(log_dir, "loss"), _history(sweep / num, "loss"))


# Steps paced (conftest.PACED), so that both of a sweep's jobs are surely training at once although
# their start-ups drift on a busy machine (unpaced, task a's 1200 steps take ~1 s).


@pytest.fixture(scope="module")
def paced_reference(tmp_path_factory) -> list[tuple[int, float]]:
    return _uninterrupted(tmp_path_factory.mktemp("paced_ref") / "run", [PACED])


def test_a_joblib_sweep_stopped_by_ctrl_c_says_so_and_resumes_into_the_same_logger_runs(tmp_path, paced_reference):
    # Ctrl-C reaches the loky workers too: each job saves and raises Stopped, which the worker
    # pickles back to the sweep (it broke joblib's pool: "A result has failed to un-serialize").
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "expgpu", "-m", "task=a,b", f"task.max_steps={STEPS}", "task.log_every=5", PACED,
           "logger=[tensorboard,mlflow]", *LAUNCHERS["joblib"], f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not all(_rows(sweep / n) >= 1 for n in "01") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = all(_rows(sweep / n) >= 1 for n in "01")
    if not seen and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    if not seen or proc.poll() is not None:
        pytest.fail(f"not both jobs seen training (exit code {proc.wait()}): {proc.communicate()[1][-3000:]}")
    os.killpg(proc.pid, signal.SIGINT)   # what a Ctrl-C in the terminal does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert any(line.startswith("expgpu: stopped at step") for line in err.splitlines()), err[-3000:]
    first = {n: json.loads((sweep / n / ".expgpu" / "loggers.json").read_text())["mlflow"]["run_id"] for n in "01"}
    assert {r.info.run_id: r.info.status for r in _mlflow_runs(sweep)} == {i: "KILLED" for i in first.values()}

    again = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=280)
    assert again.returncode == 0, again.stderr[-3000:]
    runs = {r.info.run_id: r for r in _mlflow_runs(sweep)}
    assert set(runs) == set(first.values())   # the same two MLflow runs, continued
    for n, run_id in first.items():
        result = json.loads((sweep / n / "result.json").read_text())
        assert result["status"] == "finished" and 0 < result["resumed_from_step"] < STEPS
        assert runs[run_id].info.status == "FINISHED"
        loss = _history(sweep / n, "loss")
        assert [s for s, _ in loss] == list(range(5, STEPS + 1, 5))
        _same_floats(_mlflow_history(sweep, run_id, "loss"), loss)
    _same_floats(_history(sweep / "0", "loss"), paced_reference)   # task a, as if never stopped


def test_a_stopped_sweep_job_resumed_by_hand_as_its_hint_says_continues_its_logger_runs(tmp_path, reference):
    # "Resume with the same overrides plus hydra.run.dir=SWEEP/0": a single run in the sweep's job
    # dir, which must continue the job's MLflow run in the sweep's store, not start one in a new store.
    sweep, args = tmp_path / "sweep", ARGS + ["logger=[tensorboard,mlflow]"]
    proc = subprocess.Popen([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep}"], cwd=REPO,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for_progress(proc, sweep / "0")
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, sweep / "0")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert f"Resume with the same overrides plus hydra.run.dir={sweep / '0'}" in stopped.stderr
    [killed] = _mlflow_runs(sweep)
    assert killed.info.status == "KILLED"

    resumed = expgpu(args, sweep / "0")
    assert resumed.returncode == 0 and resumed.result["resumed_from_step"] > 0, resumed.stderr[-3000:]
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("mlflow.db")] == [Path("sweep/mlflow.db")]
    [run] = _mlflow_runs(sweep)
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == ",".join(ARGS)   # still named by the sweep job's overrides (less logger=)
    _same_floats(_mlflow_history(sweep, run.info.run_id, "loss"), reference)
    [log_dir] = (sweep / "0" / "tensorboard").iterdir()   # the job's TensorBoard run, continued
    _same_floats(_tensorboard(log_dir, "loss"), reference)


def test_a_joblib_job_whose_rank_fails_is_one_line(tmp_path):
    done = _sweep(["task=a", "task.max_steps=20", "launch.nproc_per_node=2", "faults.crash_rank=1",
                   "faults.crash_step=5", "logger=mlflow", *LAUNCHERS["joblib"]], tmp_path / "sweep")
    assert done.returncode == 1 and "BrokenProcessPool" not in done.stderr, done.stderr[-3000:]
    assert ("expgpu: rank 1 failed: RuntimeError: injected crash (faults.crash_rank=1 faults.crash_step=5)"
            in done.stderr.splitlines())
    logs = "".join(p.read_text() for p in sorted((tmp_path / "sweep" / "0").rglob("*.log")))
    assert [r.info.status for r in _mlflow_runs(tmp_path / "sweep")] == ["FAILED"], done.stderr[-2000:] + logs


def test_a_hung_runs_mlflow_run_ends_as_failed_not_running_for_ever(tmp_path):
    # The watchdog ends every rank with os._exit (no exception path): rank 0 ends its loggers' runs first
    run = expgpu(["--config-dir", str(TESTS / "conf"), "task=probe_hangs", "task.how=sleep", "launch.nproc_per_node=2",
                  "launch.hang.timeout_s=5", "logger=mlflow"], tmp_path / "run",
                 env=clean_env(PYTHONPATH=str(HELPERS)), timeout=150)
    assert run.returncode == 124 and run.result["status"] == "hung", run.stderr[-3000:]
    assert [r.info.status for r in _mlflow_runs(tmp_path / "run")] == ["FAILED"]


def _rows(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def test_a_sweep_with_job_chdir_keeps_one_mlflow_store_in_the_sweep_dir(tmp_path):
    # hydra.job.chdir=true runs each job in its job dir; the sweep dir given relative (as Hydra's
    # default multirun/DATE/TIME is) still names the one under the dir the user started in.
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", *SWEEP, "logger=mlflow", "hydra.job.chdir=true",
                           "hydra.sweep.dir=sweep"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("mlflow.db")] == [Path("sweep/mlflow.db")]
    client = _mlflow(tmp_path / "sweep")
    [experiment] = [e for e in client.search_experiments() if e.name != "Default"]
    runs = client.search_runs([experiment.experiment_id])
    assert experiment.name == "sweep" and sorted(r.info.run_name for r in runs) == sorted(SWEEP_JOBS)
    for r in runs:
        assert r.data.tags["expgpu.sweep_dir"] == str(tmp_path / "sweep")


def test_a_missing_logger_package_is_one_line_naming_the_extra_before_any_rank_starts(tmp_path):
    # The package is absent for this process only: sys.modules[name] = None makes Python's import
    # system (and importlib.util.find_spec) treat it as not installed.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    env = clean_env(PYTHONPATH=str(shim))
    run = expgpu(["task=a", "logger=[csv,mlflow]", "launch.nproc_per_node=2"], tmp_path / "run", env=env)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [
        "expgpu: error: logger=mlflow: the mlflow package is not installed: pip install 'expgpu[mlflow]' "
        "(or choose another logger: csv, tensorboard, mlflow, wandb, none)"]
    assert not (run.run_dir / "logs").exists() and not (run.run_dir / "metrics.jsonl").exists()   # no rank ran
    # The same in a sweep: the job fails in one line, and the report says why.
    sweep = _sweep(["task=a", "task.max_steps=5", "logger=mlflow"], tmp_path / "sweep", env=env)
    assert sweep.returncode == 2 and "pip install 'expgpu[mlflow]'" in sweep.stderr, sweep.stderr[-3000:]
    failure = json.loads((tmp_path / "sweep" / "0" / ".expgpu" / "failure.json").read_text())
    assert "pip install 'expgpu[mlflow]'" in failure["message"]


def _wandb_records(path: Path):
    """The records of a .wandb file (W&B's transaction log: LevelDB's log format, 32 KiB blocks of
    checksum, length and type headers, after a 7-byte ':W&B' header); W&B ships no reader for it."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:   # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):   # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""
        elif kind == 0:
            break


def _wandb_history(run_dir: Path) -> tuple[set[str], list[tuple[int, float]], dict]:
    """(run ids, the loss history, the summary) of every offline W&B run dir under run_dir."""
    ids, points, summary = set(), [], {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        ids.add(path.stem.removeprefix("run-"))
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "loss" in items:
                    points.append((record.history.step.num, float(items["loss"])))
            elif kind == "summary":
                summary.update({u.key or "/".join(u.nested_key): json.loads(u.value_json)
                                for u in record.summary.update})
    return ids, points, summary


def test_wandb_offline_continues_the_same_run_after_a_stop(tmp_path):
    run_dir = tmp_path / "run"
    args = ["task=a", "task.max_steps=300", "task.log_every=5", "logger=wandb", "checkpoint.every_steps=100"]
    env = clean_env(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    killed = expgpu(args + ["faults.crash_rank=0", "faults.crash_step=153", "faults.kind=exception"], run_dir, env=env)
    assert killed.returncode == 1, killed.stderr[-3000:]
    resumed = expgpu(args, run_dir, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.result["resumed_from_step"] == 100
    ids, points, summary = _wandb_history(run_dir)
    saved = json.loads((run_dir / ".expgpu" / "loggers.json").read_text())["wandb"]["id"]
    assert ids == {saved}   # two offline pieces of one W&B run (`wandb sync` joins them)
    assert points == _history(run_dir, "loss")   # every step once, as metrics.jsonl (as if never stopped)
    assert [s for s, _ in points] == list(range(5, 301, 5))   # not the crash's own step 153
    assert summary["final_loss"] == resumed.result["metrics"]["final_loss"]
