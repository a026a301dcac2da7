"""hydra/sweeper=expgpu_optuna end to end, with real Optuna and real processes: trials that start the
moment a slot frees, pruning through run.log on every rank at one step (a script's through expgpu.log),
resume after the sweeper is stopped, and bad input as one line. The probe task (tests/helpers/tune_probe.py)
and script (tune_script.py) train by their trial's number."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HELPERS, REPO, clean_env

pytestmark = [pytest.mark.slow]

PROBE = ["--config-dir", str(REPO / "tests" / "conf"), "task=tune_probe", "objective=score",
         "hydra/sweeper=expgpu_optuna", "hydra.sweeper.sampler.seed=0", "task.x=interval(0,1)"]
POOL = ["hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2"]
# every odd trial logs score 1.0 and is pruned at its first report; even ones log 0.0 and finish
THRESHOLD = "hydra.sweeper.pruner={_target_:optuna.pruners.ThresholdPruner,upper:0.5,n_warmup_steps:2}"


def _cmd(args: list[str], sweep_dir: Path) -> list[str]:
    return [sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep_dir}"]


def _sweep(args: list[str], sweep_dir: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(args, sweep_dir), cwd=REPO, env=clean_env(PYTHONPATH=str(HELPERS)),
                          capture_output=True, text=True, timeout=timeout)


def _study(sweep_dir: Path) -> dict[int, dict]:
    return {t["number"]: t for t in json.loads((sweep_dir / "study.json").read_text())["trials"]}


def _states_in_journal(sweep_dir: Path) -> dict[int, str]:
    """The study as Optuna itself reads it from the journal file."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    st = optuna.storages.JournalStorage(JournalFileBackend(str(sweep_dir / "optuna.journal")))
    study = optuna.load_study(study_name=str(sweep_dir), storage=st)
    return {t.number: t.state.name for t in study.trials}


def _tensorboard_hparams(job_dir: Path) -> tuple[dict, list[str]]:
    """The HPARAMS tab's entry of a job's TensorBoard run: its hyperparameters, the metrics named against them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    [log_dir] = (job_dir / "tensorboard").iterdir()   # named by the job's overrides
    events = EventAccumulator(str(log_dir))
    events.Reload()
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    start = plugin_data_pb2.HParamsPluginData.FromString(content[metadata.SESSION_START_INFO_TAG])
    hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.session_start_info.hparams.items()}
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content[metadata.EXPERIMENT_TAG]).experiment
    return hparams, [m.name.tag for m in experiment.metric_infos]


def _pool(sweep_dir: Path) -> dict[int, dict]:
    return {j["num"]: j for j in json.loads((sweep_dir / "pool.json").read_text())["jobs"]}


@pytest.mark.timeout(200)
def test_pruned_trials_stop_on_every_rank_at_one_step_and_free_their_slot(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep(PROBE + POOL + [THRESHOLD, "hydra.sweeper.n_trials=4", "launch.nproc_per_node=2",
                                  "task.max_steps=40", "task.slow_step_s=0.15", "task.step_s=0.02",
                                  "logger=[csv,mlflow,tensorboard]"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _states_in_journal(sweep) == {0: "COMPLETE", 1: "PRUNED", 2: "COMPLETE", 3: "PRUNED"}
    # the pool's first line counts the study's trials, not the one it was handed first
    assert "gpu_pool: 4 jobs, each as the sweeper asks for it, on 2 CPU slots" in done.stdout + done.stderr
    # a logger's run of a pruned trial is over, as a finished one's (not KILLED: nothing resumes it), tagged
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{sweep / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    got = {Path(r.data.tags["expgpu.run_dir"]).name: (r.info.status, r.data.tags.get("expgpu.status")) for r in runs}
    assert got == {"0": ("FINISHED", None), "1": ("FINISHED", "pruned"), "2": ("FINISHED", None),
                   "3": ("FINISHED", "pruned")}, got
    # TensorBoard's HPARAMS tab has every trial, a pruned one against the metrics of its last row
    hp = {n: _tensorboard_hparams(sweep / str(n)) for n in range(4)}
    assert {n: h["expgpu.status"] for n, (h, _) in hp.items()} == {0: "finished", 1: "pruned", 2: "finished",
                                                                     3: "pruned"}, hp
    assert all(0 <= h["task.x"] <= 1 and "score" in names for h, names in hp.values()), hp
    for n in (1, 3):
        result = json.loads((sweep / str(n) / "result.json").read_text())
        assert result["status"] == "pruned" and result["stop_signal"] == "PRUNED", result
        assert result["world_size"] == 2 and 2 <= result["steps"] < 40   # stopped early, after the warm-up
        assert len(set(result["rank_checksums"])) == 1   # both ranks stopped after the same steps
        assert not (sweep / str(n) / "checkpoint.pt").exists()   # final: nothing to resume
        rows = [json.loads(line) for line in (sweep / str(n) / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == result["steps"], rows   # what it logged up to the prune is written
        assert _study(sweep)[n]["last_step"] is not None
    pool = _pool(sweep)
    # trial 1's slot was free at once: trial 2 started in it while slow trial 0 still ran
    assert pool[1]["ended"] <= pool[2]["started"] < pool[0]["ended"] and pool[2]["slot"] == pool[1]["slot"], pool
    assert "pruned" in (sweep / "report.csv").read_text()


@pytest.mark.timeout(200)
def test_a_script_trial_is_pruned_on_every_rank_from_the_rows_it_logs(tmp_path):
    # tests/helpers/tune_script.py: 2 ranks all-reducing every step, score by trial number, no SIGTERM handler
    sweep = tmp_path / "sweep"
    done = _sweep(["--config-dir", str(REPO / "tests" / "conf"), "task=tune_script", "objective=score",
                   "hydra/sweeper=expgpu_optuna", "hydra.sweeper.sampler.seed=0", "task.args.x=interval(0,1)",
                   *POOL, THRESHOLD, "hydra.sweeper.n_trials=4", "launch.nproc_per_node=2"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _states_in_journal(sweep) == {0: "COMPLETE", 1: "PRUNED", 2: "COMPLETE", 3: "PRUNED"}
    for n in (1, 3):
        result = json.loads((sweep / str(n) / "result.json").read_text())
        assert result["status"] == "pruned" and result["stop_signal"] == "PRUNED", result
        # both ranks' scripts stopped: by the SIGTERM passed on (143), or, rank 1, by its collective with the
        # stopped rank 0 (1): either way pruned, not failed
        assert result["exit_codes"][0] == 143 and result["exit_codes"][1] in (1, 143), result
        # judged from step 3 (n_warmup_steps=2) and stopped then, long before its 400 steps end (20 s unpruned)
        assert 3 <= result["steps"] < 400, result
        assert _study(sweep)[n]["last_step"] is not None
    assert json.loads((sweep / "0" / "result.json").read_text())["steps"] == 40
    assert "never logged" not in done.stdout + done.stderr


@pytest.mark.timeout(200)
def test_a_fast_trials_slot_is_reused_before_the_slow_one_ends(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep(PROBE + POOL + ["hydra.sweeper.n_trials=5", "task.max_steps=30", "task.slow_step_s=0.2",
                                  "task.step_s=0.01"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(_states_in_journal(sweep).values()) == {"COMPLETE"}
    pool = _pool(sweep)
    assert all(pool[n]["started"] < pool[0]["ended"] for n in (1, 2, 3, 4)), pool   # all beside trial 0
    assert all(pool[n]["slot"] == pool[1]["slot"] for n in (2, 3, 4))
    best = (sweep / "optimization_results.yaml").read_text()
    assert "best_value: 0.0" in best


@pytest.mark.timeout(240)
def test_a_rerun_of_a_stopped_sweep_keeps_its_trials_and_resumes_the_running_one(tmp_path):
    sweep = tmp_path / "sweep"
    args = PROBE + ["hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=1", "hydra.sweeper.n_trials=3",
                    "task.max_steps=60", "task.slow_step_s=0.02", "task.step_s=0.1"]
    proc = subprocess.Popen(_cmd(args, sweep), cwd=REPO, env=clean_env(PYTHONPATH=str(HELPERS)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    rows = sweep / "1" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (rows.exists() and rows.read_text().count("\n") >= 5):   # trial 1 is well under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C: the trial saves, the sweeper ends
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the stopped sweep did not end within 60 s: {proc.communicate()[1][-3000:]}")
    assert proc.returncode == 130, err[-3000:]
    assert f"rerun the same command with hydra.sweep.dir={sweep} to continue the study" in out + err
    first = json.loads((sweep / "0" / "result.json").read_text())
    stopped = json.loads((sweep / "1" / "result.json").read_text())
    assert first["status"] == "finished" and stopped["status"] == "stopped", stopped
    assert _states_in_journal(sweep)[1] == "RUNNING"

    again = _sweep(args, sweep)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _states_in_journal(sweep) == {0: "COMPLETE", 1: "COMPLETE", 2: "COMPLETE"}   # n_trials in all
    assert json.loads((sweep / "0" / "result.json").read_text()) == first   # kept, not run again
    resumed = json.loads((sweep / "1" / "result.json").read_text())
    assert resumed["status"] == "finished" and resumed["resumed_from_step"] == stopped["steps"] > 0
    assert [r["step"] for r in map(json.loads, (sweep / "1" / "metrics.jsonl").read_text().splitlines())] == \
        list(range(1, 61))   # one row per step, as if never stopped


@pytest.mark.timeout(150)
def test_under_the_basic_launcher_trials_run_in_batches_and_are_pruned_too(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep(PROBE + [THRESHOLD, "hydra.sweeper.n_trials=3", "task.max_steps=20"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    # the jobs run in the sweeper's own process, one after another: a pruned one leaves no stop behind
    assert _states_in_journal(sweep) == {0: "COMPLETE", 1: "PRUNED", 2: "COMPLETE"}
    assert json.loads((sweep / "2" / "result.json").read_text())["steps"] == 20


@pytest.mark.timeout(200)
def test_status_shows_each_trial_by_the_searchs_objective_first(tmp_path):
    """`expgpu status SWEEP`: a trial's row leads with the objective (its table shows a row's first 3 values;
    the built-in loop logs loss, lr and eval_loss before accuracy). A trial between evaluations, whose last row
    does not hold it, shows the latest value it reported to the study. The search's own row: its best so far."""
    sweep = tmp_path / "sweep"
    done = _sweep(["hydra/sweeper=expgpu_optuna", "hydra.sweeper.sampler.seed=0", "hydra.sweeper.n_trials=3",
                   "hydra/sweeper/pruner=successive_halving", "hydra.sweeper.pruner.min_resource=100",
                   "task.optimizer.lr=tag(log,interval(1e-3,1e-1))", "task=digits", "task.max_steps=200",
                   "task.eval_every=100", "objective=accuracy", "hydra.sweeper.direction=maximize"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]

    def rows() -> dict[str, dict]:
        shown = subprocess.run([sys.executable, "-m", "expgpu.status", str(sweep), "--json"], cwd=REPO,
                               env=clean_env(), capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        return {Path(r["dir"]).name: r for r in json.loads(shown.stdout)}

    study = _study(sweep)
    assert [next(iter(r["metrics"])) for r in rows().values()] == ["accuracy"] * 3
    # the search as one row (its parent dir listed): finished, and its best value so far
    [whole] = json.loads(subprocess.run([sys.executable, "-m", "expgpu.status", str(tmp_path), "--json"], cwd=REPO,
                                        env=clean_env(), capture_output=True, text=True, timeout=60).stdout)
    completed = [t["values"][0] for t in study.values() if t["state"] == "COMPLETE"]
    assert whole["kind"] == "sweep" and whole["status"] == "finished"
    assert whole["metrics"] == {"accuracy": max(completed)}
    # trial 0 as it was between its evaluations at steps 100 and 200: its result not yet written
    job = sweep / "0"
    (job / "result.json").unlink()
    kept = [line for line in (job / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 150]
    (job / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    assert "accuracy" not in json.loads(kept[-1])
    row = rows()["0"]
    assert row["step"] == 150 and list(row["metrics"])[:2] == ["accuracy", "loss"]
    assert row["metrics"]["accuracy"] == study[0]["last_value"]


@pytest.mark.timeout(150)
def test_a_search_whose_every_trial_is_pruned_exits_1_with_one_line(tmp_path):
    """No trial completed: there is no best to write, and a script that reads the exit code must know."""
    sweep = tmp_path / "sweep"
    every = THRESHOLD.replace("upper:0.5", "upper:-0.5")   # both scores (0.0 and 1.0) are above it
    done = _sweep(PROBE + [every, "hydra.sweeper.n_trials=2", "task.max_steps=20"], sweep)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "expgpu: no trial completed: 2 pruned, the pruner (ThresholdPruner) stopped every trial before its last step")
    assert "Traceback" not in done.stderr
    assert _states_in_journal(sweep) == {0: "PRUNED", 1: "PRUNED"}
    assert not (sweep / "optimization_results.yaml").exists()


@pytest.mark.timeout(150)
def test_a_trial_whose_objective_turns_nan_is_pruned_and_the_search_goes_on(tmp_path):
    """digits at lr 1e36 diverges: its eval_loss is nan from the first evaluation. Optuna's pruners prune a
    trial that reports nan; expgpu once left nan out of the reports, so the trial trained to its end and its nan
    objective failed it, and at max_failure_rate 0 the search stopped there (exit 1)."""
    sweep = tmp_path / "sweep"
    done = _sweep(["hydra/sweeper=expgpu_optuna", *POOL, "task=digits", "task.optimizer.lr=choice(1e-3,1e36)",
                   "task.eval_every=50", "objective=eval_loss", "hydra.sweeper.n_trials=4",
                   "hydra/sweeper/pruner=threshold", "hydra.sweeper.pruner.upper=1e9", "hydra.sweeper.sampler.seed=1"],
                  sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    study = _study(sweep)
    states = {t["params"]["task.optimizer.lr"]: set() for t in study.values()}
    for t in study.values():
        states[t["params"]["task.optimizer.lr"]].add(t["state"])
    assert states == {1e-3: {"COMPLETE"}, 1e36: {"PRUNED"}}, study   # the seed's 4 random draws hold both
    for n, t in study.items():
        if t["state"] == "PRUNED":   # at its first evaluation, not at its end
            result = json.loads((sweep / str(n) / "result.json").read_text())
            assert result["status"] == "pruned" and result["steps"] < 400, result


@pytest.mark.timeout(150)
def test_under_on_nonfinite_stop_a_diverged_trial_ends_at_once_as_pruned_without_a_pruner(tmp_path):
    """task.on_nonfinite=stop: a trial whose loss turns nan stops there and counts as PRUNED (the sampler learns the
    region is bad), not as a failure; a search of nothing but such trials ends in one line that says why."""
    search = ["hydra/sweeper=expgpu_optuna", *POOL, "task=digits", "task.on_nonfinite=stop", "objective=accuracy",
              "hydra.sweeper.direction=maximize", "hydra.sweeper.sampler.seed=1"]
    sweep = tmp_path / "sweep"
    done = _sweep([*search, "task.optimizer.lr=choice(1e-3,1e36)", "hydra.sweeper.n_trials=4"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    for n, t in _study(sweep).items():
        diverged = t["params"]["task.optimizer.lr"] == 1e36
        assert t["state"] == ("PRUNED" if diverged else "COMPLETE"), t
        result = json.loads((sweep / str(n) / "result.json").read_text())
        assert result["status"] == ("diverged" if diverged else "finished"), result
        if diverged:
            assert t["reason"] == "diverged: loss nan or inf from step 10" and result["steps"] < 400, (t, result)
    assert "diverged at step" in done.stdout + done.stderr   # gpu_pool's line for the job
    every = _sweep([*search, "task.optimizer.lr=choice(1e36,1e37)", "hydra.sweeper.n_trials=2"], tmp_path / "every")
    assert every.returncode == 1, every.stderr[-3000:]
    assert every.stderr.strip().splitlines()[-1].startswith(
        "expgpu: no trial completed: 2 diverged, every trial's loss became nan or inf"), every.stderr[-2000:]


@pytest.mark.parametrize("args,says", [
    (["hydra.sweeper.pruner={_target_:optuna.pruners.MedianPruner,warmup:3}"],
     "hydra.sweeper.pruner._target_=optuna.pruners.MedianPruner: does not take (warmup=3)"),
    (["hydra.sweeper.sampler._target_=optuna.samplers.Nope"], "hydra.sweeper.sampler._target_=optuna.samplers.Nope: "
                                                               "cannot be imported"),
    (["hydra.sweeper.direction=up"], "hydra.sweeper.direction='up' is not allowed: minimize or maximize"),
    (["+hydra.sweeper.params.x='interval(0'"], "hydra.sweeper.params.x=interval(0: not a sweep expression Hydra can"),
    (["hydra/sweeper/sampler=grid"], "hydra/sweeper/sampler=grid: task.x is sampled from a continuous"),
    (["hydra.sweeper.max_failure_rate=2"], "hydra.sweeper.max_failure_rate=2.0 is not allowed: a fraction from 0 to 1"),
    (["+hydra.sweeper.trials=3"], "hydra.sweeper.trials: unknown key; allowed under hydra.sweeper: _target_, "
                                  "defaults, _recursive_, n_trials"),
    (["objective=null"], "objective=None: hydra/sweeper=expgpu_optuna needs the metric to optimize"),
    (["hydra.sweeper.storage=sqlite:////nonexistent/dir/s.db"], "hydra.sweeper.storage=sqlite:////nonexistent/"
                                                                "dir/s.db: cannot be opened"),
    (["objective=accuracy"], "trial 0: objective=accuracy: the task returned no metric 'accuracy'; it returned "
                             "score, x"),
    # every trial's job would refuse it at its start, after its wait in the queue: said before the study opens
    (["hydra/launcher=submitit_local", "task.xx=1"], "task.xx: tune_probe.train takes no parameter 'xx'"),
])
@pytest.mark.timeout(120)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    done = _sweep(PROBE + ["hydra.sweeper.n_trials=6", "task.max_steps=3"] + args, tmp_path / "sweep", 110)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("expgpu: error: ") and says in last, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    if args == ["objective=accuracy"]:   # said after the first trial, not after all six
        assert _states_in_journal(tmp_path / "sweep") == {0: "FAIL"}
    if "task.xx=1" in args:
        assert last.endswith("; in every trial; nothing was submitted"), last
        assert not (tmp_path / "sweep" / "optuna.journal").exists() and not (tmp_path / "sweep" / ".submitit").exists()


@pytest.mark.timeout(120)
def test_a_study_name_that_exists_with_other_directions_is_one_line(tmp_path):
    store = f"hydra.sweeper.storage=sqlite:///{tmp_path}/s.db"
    first = _sweep(PROBE + ["hydra.sweeper.n_trials=1", "task.max_steps=3", store, "hydra.sweeper.study_name=s"],
                   tmp_path / "one")
    assert first.returncode == 0, first.stderr[-3000:]
    done = _sweep(PROBE + ["hydra.sweeper.n_trials=1", "task.max_steps=3", store, "hydra.sweeper.study_name=s",
                           "hydra.sweeper.direction=maximize"], tmp_path / "two")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "hydra.sweeper.study_name=s: the study in sqlite:///" in last, done.stderr[-2000:]
    assert "exists with direction ['minimize'], not ['maximize']" in last


@pytest.mark.timeout(150)
def test_an_objective_the_task_does_not_return_stops_the_pool_sweep_after_one_trial_and_keeps_the_rest(tmp_path):
    sweep = tmp_path / "sweep"
    # trial 0 ends first (fast); the trials beside it are stopped, saved, and left for a rerun
    done = _sweep(PROBE + POOL + ["objective=accuracy", "hydra.sweeper.n_trials=6", "task.max_steps=200",
                                  "task.slow_step_s=0.001", "task.step_s=0.05"], sweep)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "trial 0: objective=accuracy: the task returned no metric" in last, \
        done.stderr[-3000:]
    states = _states_in_journal(sweep)
    assert states[0] == "FAIL" and set(states.values()) == {"FAIL", "RUNNING"} and len(states) < 6, states
    for n, state in states.items():
        if state == "RUNNING" and (sweep / str(n) / "result.json").exists():
            assert json.loads((sweep / str(n) / "result.json").read_text())["status"] == "stopped"


def test_a_dry_run_plans_the_first_trials_and_stores_no_study(tmp_path):
    # dry_run=true trains nothing, so no trial has an objective: the trials that would start first (2 slots here)
    # print their plans, and the search ends there with exit 0, not as failed trials, and leaves no study behind
    # for a rerun into this sweep dir to continue
    sweep = tmp_path / "sweep"
    done = _sweep(PROBE + POOL + ["dry_run=true"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dry run: the first 2 of 20 trial(s) planned, nothing trained" in done.stdout + done.stderr
    assert sorted(p.parent.name for p in sweep.glob("*/plan.json")) == ["0", "1"]
    sampled = [line for n in "01" for line in (sweep / n / ".hydra" / "overrides.yaml").read_text().splitlines()
               if "task.x=" in line]
    assert len(set(sampled)) == 2, sampled   # two points of the space, sampled as a search would
    assert not (sweep / "optuna.journal").exists() and not (sweep / "study.json").exists()
