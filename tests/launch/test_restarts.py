"""In-run restarts (launch.max_restarts, launch.on_hang=restart; expgpu.launch.restarts): the policy and the
attempts' record in this process, then real 2-rank runs over gloo on CPU whose rank 1 crashes or hangs in the
first attempt only (they end with the parameters of a run that never failed, bitwise) or in every attempt (they
stop at the repeat), a script task, and a plain sbatch job on the local SLURM cluster."""

from __future__ import annotations

import csv
import json
import os
import time

import pytest
from slurm_cluster import restarts as requeues
from slurm_cluster import slurm_cluster  # noqa: F401

from conftest import HELPERS, REPO, TESTS, clean_env, expgpu
from expgpu import results, rundir
from expgpu.errors import EXIT_HUNG
from expgpu.launch import restarts
from expgpu.launch.restarts import Policy, decide

CRASH = "RuntimeError: injected crash (faults.crash_rank=1 faults.crash_step=13)"
HANG = ("rank 1 has not finished step 6 for {} s (limit 5 s); rank 1 at hang_probe.py:30 in hangs: "
        "time.sleep(3600); the others (rank 0) wait in torch's _engine_run_backward")


def crash(attempt: int, step: int | None = 13, reason: str = CRASH, ranks=(1,)) -> dict:
    return {"attempt": attempt, "kind": "crash", "reason": reason, "ranks": list(ranks), "step": step, "at": "t"}


def hang(attempt: int, waited: int = 6, step: int = 5) -> dict:
    return {"attempt": attempt, "kind": "hung", "reason": HANG.format(waited), "ranks": [1], "step": step, "at": "t"}


def test_a_crash_restarts_until_the_attempts_are_spent_or_it_fails_the_same_way_again(tmp_path):
    two = Policy(max_restarts=2)
    first = decide([crash(1)], two, tmp_path)
    assert first.restart and first.text == (f"restart 1 of 2: rank 1 failed: {CRASH} at step 13; starting again "
                                            "from the last checkpoint")
    again = decide([crash(1), crash(2)], two, tmp_path)
    assert not again.restart and again.text == (f"rank 1 failed again at step 13 for the same reason ({CRASH}): "
                                                "not restarting (attempt 2 of 3)")
    # at another step, or for another reason, or on another rank: a failure of its own, restarted
    assert decide([crash(1), crash(2, step=17)], two, tmp_path).restart
    assert decide([crash(1), crash(2, reason="killed by SIGKILL")], two, tmp_path).restart
    assert decide([crash(1), crash(2, ranks=(0,))], two, tmp_path).restart
    spent = decide([crash(1), crash(2, step=17), crash(3, step=21)], two, tmp_path)
    assert not spent.restart and spent.text == f"rank 1 failed: {CRASH} (attempt 3 of 3, no restarts left)"
    # launch.max_restarts=0 (the default), or a stop signal that reached the supervisor: the failure's own line
    assert decide([crash(1)], Policy(), tmp_path) == restarts.Decision(False, None)
    assert decide([crash(1)], two, tmp_path, stopping=True) == restarts.Decision(False, None)


def test_a_hang_restarts_only_under_on_hang_restart_and_its_seconds_do_not_make_it_another_reason(tmp_path):
    fail = decide([hang(1)], Policy(max_restarts=2), tmp_path)
    assert not fail.restart and fail.text == (f"hung: {HANG.format(6)} (every rank's stacks: {tmp_path / 'hang'}); "
                                              "not restarted: launch.on_hang=fail")
    policy = Policy(max_restarts=2, on_hang="restart")
    first = decide([hang(1)], policy, tmp_path)
    assert first.restart and first.text == (f"restart 1 of 2: hung at step 5 ({HANG.format(6)}); starting again "
                                            f"from the last checkpoint (this attempt's stacks: {tmp_path / 'hang-1'})")
    again = decide([hang(1, waited=6), hang(2, waited=7)], policy, tmp_path)
    assert not again.restart and again.text.startswith(f"rank 1 hung again at step 5 for the same reason ({HANG[:4]}")
    assert again.text.endswith(f"): not restarting (attempt 2 of 3); every rank's stacks: {tmp_path / 'hang'}")
    assert decide([hang(1), hang(2, step=9)], policy, tmp_path).restart


def test_result_json_lists_the_failed_attempts_of_this_launch_then_its_own(tmp_path, monkeypatch):
    results.record_attempt(tmp_path, crash(1))
    results.record_attempt(tmp_path, crash(2, step=17))
    assert [r["attempt"] for r in results.read_attempts(tmp_path)] == [1, 2]
    monkeypatch.setenv("EXPGPU_ATTEMPT", "3")
    doc = {k: None for k in results.EVERY_RUN + results.FUNCTION_KEYS} | {"status": "finished", "steps": 30}
    written = json.loads(json.dumps(results.write_result(tmp_path, doc)))
    assert written == results.read_result(tmp_path)
    assert [(a["attempt"], a["kind"], a["step"]) for a in written["attempts"]] == \
        [(1, "crash", 13), (2, "crash", 17), (3, "finished", 30)]
    # a row of an earlier launch in this run dir, numbered as this attempt or later, is not this launch's
    monkeypatch.setenv("EXPGPU_ATTEMPT", "2")
    assert [a["attempt"] for a in results.write_result(tmp_path, doc)["attempts"]] == [1, 2]
    assert [r["attempt"] for r in results.record_attempt(tmp_path, crash(1, step=3))] == [1]
    monkeypatch.delenv("EXPGPU_ATTEMPT")   # no restart loop: attempt 1
    assert [a["kind"] for a in results.write_result(tmp_path, doc)["attempts"]] == ["finished"]


def test_a_restart_resumes_whatever_checkpoint_resume_says():
    cfg = {"launch": {"max_restarts": 1}, "checkpoint": {"resume": False, "every_steps": 5}}
    assert restarts.resuming(cfg) == {**cfg, "checkpoint": {"resume": True, "every_steps": 5}}
    assert cfg["checkpoint"]["resume"] is False   # the first attempt's, untouched


def test_the_step_reached_is_the_last_whole_row_of_metrics_jsonl(tmp_path):
    path = tmp_path / rundir.METRICS
    assert restarts.last_step(path) is None
    rows = "".join(json.dumps({"step": s, "loss": 1.0 / s, "epoch": 0, "time": 0.0}) + "\n" for s in range(1, 5001))
    path.write_text(rows + '{"step": 5001, "lo')   # longer than the tail read, and torn by a kill mid-write
    assert restarts.last_step(path) == 5000


def _step_dir(tmp_path, max_restarts: int = 1, on_hang: str = "fail"):
    """A run dir as an srun step of scripts/expgpu.sbatch leaves it: Hydra's config, and metrics up to step 13."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(
        f"task:\n  max_steps: 30\nlaunch:\n  max_restarts: {max_restarts}\n  on_hang: {on_hang}\n")
    (run_dir / "checkpoint.pt").write_bytes(b"")
    (run_dir / rundir.METRICS).write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 14)))
    return run_dir


def test_after_an_srun_step_what_it_left_in_the_run_dir_says_whether_it_starts_again(tmp_path, capsys):
    run_dir, started = _step_dir(tmp_path), time.time()
    results.write_job_failure(run_dir, CRASH, rank=1, step=13)   # srun gives 143: the peer --kill-on-bad-exit ended
    assert restarts.after_step(run_dir, 1, 143, started) == 0
    assert capsys.readouterr().err == (f"expgpu: restart 1 of 1: rank 1 failed: {CRASH} at step 13; starting again "
                                       "from the last checkpoint\n")
    assert restarts.after_step(run_dir, 2, 143, started) == 1   # the same failure again: a crash's code
    assert "expgpu: rank 1 failed again at step 13 for the same reason (" in capsys.readouterr().err
    assert [(r["attempt"], r["ranks"], r["reason"]) for r in results.read_attempts(run_dir)] == \
        [(1, [1], CRASH), (2, [1], CRASH)]


def test_after_an_srun_step_a_stop_or_a_user_error_never_starts_it_again(tmp_path, capsys):
    run_dir = _step_dir(tmp_path, max_restarts=3)
    old = rundir.job_failure_file(run_dir)
    results.write_job_failure(run_dir, CRASH, rank=1)
    os.utime(old, (time.time() - 600, time.time() - 600))   # an earlier step's
    started = time.time()
    assert restarts.after_step(run_dir, 1, 143, started) == 143   # SIGTERM, and no failure since: a stop
    (run_dir / rundir.RESULT).write_text(json.dumps({"status": "stopped"}))
    assert restarts.after_step(run_dir, 1, 140, started) == 140
    assert restarts.after_step(run_dir, 1, 2, started) == 2
    results.write_job_failure(run_dir, "task.lr: no such parameter", user_error=True)
    assert restarts.after_step(run_dir, 1, 1, started) == 1
    assert capsys.readouterr().err == "" and results.read_attempts(run_dir) == []


def test_after_an_srun_step_a_hang_starts_it_again_under_on_hang_restart_with_its_stacks_kept(tmp_path, capsys):
    run_dir, started = _step_dir(tmp_path, on_hang="restart"), time.time()
    rundir.hang_dir(run_dir).mkdir()
    rundir.hang_verdict(run_dir).write_text(json.dumps({"line": HANG.format(6), "culprits": [1],
                                                        "ranks": {"0": {"step": 6}, "1": {"step": 5}}}))
    (run_dir / rundir.RESULT).write_text(json.dumps({"status": "hung"}))
    assert restarts.after_step(run_dir, 1, EXIT_HUNG, started) == 0
    assert f"expgpu: restart 1 of 1: hung at step 5 ({HANG.format(6)}); " in capsys.readouterr().err
    assert (run_dir / "hang-1" / "verdict.json").exists() and (run_dir / "hang-1" / "result.json").exists()
    assert not rundir.hang_dir(run_dir).exists() and not (run_dir / rundir.RESULT).exists()
    # an expgpu spawn inside the step (launch.nproc_per_node) said which rank, in its line
    results.write_job_failure(run_dir, f"rank 1 failed: {CRASH}")
    assert restarts.after_step(run_dir, 2, 1, started) == 1   # no restarts left
    assert results.read_attempts(run_dir)[-1]["ranks"] == [1] and results.read_attempts(run_dir)[-1]["reason"] == CRASH


# Real runs. Checkpoints every 5 steps, a row every step: a crash at step 13 resumes from step 10.
STEPS = 30
ARGS = ["task=a", f"task.max_steps={STEPS}", "task.log_every=1", "checkpoint.every_steps=5", "backend.timeout_s=60"]
FAULT = ["faults.crash_rank=1", "faults.crash_step=13"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """result.json and the loss history of the run that never failed (2 ranks, expgpu's spawn)."""
    run = expgpu(ARGS + ["launch.nproc_per_node=2", "logger=none"], tmp_path_factory.mktemp("ref") / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    return {**run.result, "loss": [(r["step"], r["loss"]) for r in run.metrics()]}


def _mlflow_runs(store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    return client, [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("resume", [[], ["checkpoint.resume=false"]], ids=["resume", "resume_false"])
def test_a_crash_in_the_first_attempt_restarts_from_the_checkpoint_and_ends_as_a_run_that_never_failed(
        tmp_path, reference, resume):
    # checkpoint.resume=false is about an earlier launch's checkpoint: a restart resumes from its own
    run = expgpu(ARGS + FAULT + ["faults.crash_attempts=1", "launch.nproc_per_node=2", "launch.max_restarts=2",
                                 "logger=[csv,mlflow]", *resume], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.output.splitlines() if "restart 1 of 2: " in line]
    assert len(said) == 1 and said[0].endswith(f"restart 1 of 2: rank 1 failed: {CRASH} at step 13; starting again "
                                               "from the last checkpoint"), run.stderr[-3000:]
    res = run.result
    assert (res["status"], res["steps"], res["resumed_from_step"]) == ("finished", STEPS, 10)
    assert res["param_checksum"] == reference["param_checksum"] and res["rank_checksums"] == reference["rank_checksums"]
    assert [(a["attempt"], a["kind"], a["ranks"], a["step"]) for a in res["attempts"]] == \
        [(1, "crash", [1], 13), (2, "finished", None, STEPS)]
    assert res["attempts"][0]["reason"] == CRASH and res["attempts"][0]["at"] <= res["attempts"][1]["at"]
    # the loggers go on with the same run: every step once, the losses of the run that never failed
    assert [(r["step"], r["loss"]) for r in run.metrics()] == reference["loss"]
    with open(run.run_dir / "metrics.csv", newline="") as f:
        assert [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)] == reference["loss"]
    client, [logged] = _mlflow_runs(run.run_dir)   # one MLflow run, not one per attempt
    assert logged.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(logged.info.run_id, "loss"))
    assert [s for s, _ in history] == [s for s, _ in reference["loss"]]
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(history, reference["loss"]))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_crash_in_every_attempt_stops_at_the_first_repeat_with_one_line(tmp_path):
    run = expgpu(ARGS + FAULT + ["launch.nproc_per_node=2", "launch.max_restarts=3", "logger=none"], tmp_path / "run")
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"expgpu: rank 1 failed again at step 13 for the same reason ({CRASH}): not restarting (attempt 2 of 4)")
    assert run.output.count("restart 1 of 3: ") == 1 and "restart 2 of 3" not in run.output
    rows = json.loads((run.run_dir / ".expgpu" / "attempts.json").read_text())
    assert [(r["attempt"], r["kind"], r["step"]) for r in rows] == [(1, "crash", 13), (2, "crash", 13)]
    assert not (run.run_dir / "result.json").exists()


def _hangs(tmp_path, *extra: str, name: str = "run"):
    # Rank 1 stops in step 18 (at=17), 7 steps of 0.3 s after the checkpoint at step 10 that a restart resumes
    # from: not in an attempt's first step, which the watchdog gives launch.hang.slow_phase_s.
    args = ["--config-dir", str(TESTS / "conf"), "launch.nproc_per_node=2", "launch.hang.timeout_s=5",
            "task.max_steps=24", "checkpoint.every_steps=10", "backend.timeout_s=60", "logger=none", *extra]
    return expgpu(args, tmp_path / name, env=clean_env(PYTHONPATH=str(HELPERS)), timeout=200)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hang_in_the_first_attempt_restarts_under_on_hang_restart_and_ends_as_a_run_that_never_hung(tmp_path):
    run = _hangs(tmp_path, "task=probe_hangs_once", "task.at=17", "task.step_s=0.3", "launch.on_hang=restart",
                 "launch.max_restarts=1")
    assert run.returncode == 0, run.stderr[-3000:]
    never = _hangs(tmp_path, "task=probe_hangs_once", "task.at=-1", name="never")   # the same math, no hang
    assert never.returncode == 0, never.stderr[-3000:]
    res = run.result
    assert res["status"] == "finished" and res["resumed_from_step"] == 10
    assert res["param_checksum"] == never.result["param_checksum"]
    assert [(a["attempt"], a["kind"], a["ranks"], a["step"]) for a in res["attempts"]] == \
        [(1, "hung", [1], 17), (2, "finished", None, 24)]
    assert res["attempts"][0]["reason"].startswith("rank 1 has not finished step 18 for ")
    said = [line for line in run.output.splitlines() if "restart 1 of 1: hung at step 17 (rank 1 has not " in line]
    assert len(said) == 1 and said[0].endswith(f"starting again from the last checkpoint (this attempt's stacks: "
                                               f"{run.run_dir / 'hang-1'})"), run.stderr[-3000:]
    # the hung attempt's stacks, verdict and result.json are kept apart; the second attempt left no hang/
    kept = run.run_dir / "hang-1"
    assert json.loads((kept / "verdict.json").read_text())["culprits"] == [1]
    assert json.loads((kept / "result.json").read_text())["status"] == "hung"
    assert "time.sleep(3600)" in (kept / "rank1.txt").read_text() and not (run.run_dir / "hang").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_on_hang_fail_never_restarts_a_hang_even_with_restarts_left(tmp_path):
    run = _hangs(tmp_path, "task=probe_hangs_once", "task.at=17", "task.step_s=0.3", "launch.max_restarts=2")
    assert run.returncode == EXIT_HUNG, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: hung: rank 1 has not finished step 18 for ") and \
        last.endswith("; not restarted: launch.on_hang=fail"), last
    assert "restart 1 of 2" not in run.output
    assert run.result["status"] == "hung" and [a["kind"] for a in run.result["attempts"]] == ["hung"]
    assert (run.run_dir / "hang" / "verdict.json").exists() and not (run.run_dir / "hang-1").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hang_in_every_attempt_stops_at_the_first_repeat(tmp_path):
    run = _hangs(tmp_path, "task=probe_hangs", "task.at=17", "task.step_s=0.3", "launch.on_hang=restart",
                 "launch.max_restarts=2")
    assert run.returncode == EXIT_HUNG, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: rank 1 hung again at step 17 for the same reason (rank 1 has not finished "
                           "step 18 for "), last
    assert f"): not restarting (attempt 2 of 3); every rank's stacks: {run.run_dir / 'hang'}" in last, last
    assert run.output.count("restart 1 of 2: hung at step 17") == 1
    assert (run.run_dir / "hang-1" / "verdict.json").exists() and (run.run_dir / "hang" / "verdict.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_task_that_crashes_once_starts_again_with_its_resume_args_and_finishes(tmp_path):
    # rank 1's script fails at step 3; rank 0's saves ckpt.txt every step: the restart resumes from it
    run = expgpu(["--config-dir", str(TESTS / "conf"), "task=script_probe_crash_once", "launch.nproc_per_node=2",
                  "launch.max_restarts=1"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.output.splitlines() if "restart 1 of 1: rank 1 failed: its script exited " in line]
    assert len(said) == 1 and said[0].endswith("starting the script again, with task.resume_args where they apply")
    res = run.result
    assert (res["status"], res["exit_codes"], res["resumed"]) == ("finished", [0, 0], True)
    assert [(a["attempt"], a["kind"], a["ranks"]) for a in res["attempts"]] == \
        [(1, "crash", [1]), (2, "finished", None)]
    assert res["attempts"][0]["reason"].startswith("its script exited with code 3; the last lines of its stderr: ")
    done = json.loads((run.run_dir / "done-rank1.json").read_text())
    assert done["steps"] == 6 and done["first"] >= 3   # resumed from the checkpoint, not from step 0
    assert "--resume" in json.loads((run.run_dir / "started-rank1.json").read_text())["argv"]
    losses = [r["step"] for r in run.metrics() if "loss" in r]
    assert losses == [1, 2, 3, 4, 5, 6]   # expgpu.log's rows go on: every step once


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_sbatch_starts_the_srun_step_again_after_a_crash_in_the_same_job(slurm_cluster, tmp_path, reference):
    job = slurm_cluster.sbatch(["--cpus-per-task=1", "--gpus-per-node=0", str(REPO / "scripts" / "expgpu.sbatch"),
                                *ARGS, *FAULT, "faults.crash_attempts=1", "launch.max_restarts=1", "logger=none"],
                               cwd=tmp_path)
    out = tmp_path / f"slurm-{job}.out"
    assert slurm_cluster.wait_job(job, timeout=240) == "COMPLETED", out.read_text()[-4000:]
    log = out.read_text()
    assert requeues(slurm_cluster, job) == 0   # the same allocation, not a requeue
    assert (f"expgpu: restart 1 of 1: rank 1 failed: {CRASH} at step 13; starting again from the last checkpoint"
            in log.splitlines()), log[-4000:]
    res = json.loads((tmp_path / "outputs" / "slurm" / job / "result.json").read_text())
    assert (res["status"], res["source"], res["world_size"], res["resumed_from_step"]) == ("finished", "slurm", 2, 10)
    assert res["param_checksum"] == reference["param_checksum"]   # as expgpu's own 2-rank spawn, never failed
    assert [(a["attempt"], a["kind"], a["ranks"], a["step"]) for a in res["attempts"]] == \
        [(1, "crash", [1], 13), (2, "finished", None, STEPS)]

