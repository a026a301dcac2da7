"""Script tasks watched for hangs (expgpu.script.watch): the verdict on the ranks' records and its line, in this
process; then tests/scripts/probe_script.py run by expgpu, whose rank 1 sleeps for ever after logging a step,
whose ranks stop printing (task.output_timeout_s), or print slowly but steadily, and a hang restarted."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, expgpu
from expgpu.errors import EXIT_HUNG
from expgpu.procs import stacks
from expgpu.procs.hang_rules import HangSettings
from expgpu.script import watch
from expgpu.script.heartbeat import Beat, Heartbeat

CONF = ["--config-dir", str(REPO / "tests" / "conf")]
FIVE = HangSettings(timeout_s=5.0, slow_phase_s=60.0)
AUTO = HangSettings(timeout_s=None, slow_phase_s=600.0)
NOW = 10_000.0


def rec(step=-1, moved_ago=0.0, phase="train", output_ago=None, step_s=0.5):
    out = {"phase": phase, "logged": phase not in ("start",) and step >= 0, "step": step, "moved": NOW - moved_ago,
           "step_s": step_s}
    if output_ago is not None:
        out["output"] = NOW - output_ago
    return out


def test_a_hang_is_every_running_rank_past_its_limit_by_the_step_it_logged():
    assert watch.judge({0: rec(9, 6.0), 1: rec(4, 3.0)}, FIVE, None, NOW) is None   # rank 1 logged 3 s ago
    verdict = watch.judge({0: rec(9, 6.0), 1: rec(4, 7.5)}, FIVE, None, NOW)
    assert (verdict["behind"], verdict["sign"], verdict["step"], verdict["waited_s"], verdict["limit_s"]) == \
        ([1], "steps", 9, 7.5, 5.0)
    # a rank whose script ended is no hang of its own
    assert watch.judge({0: rec(20, 100.0, "done"), 1: rec(4, 3.0)}, FIVE, None, NOW) is None
    assert watch.judge({0: rec(20, 100.0, "done"), 1: rec(4, 6.0)}, FIVE, None, NOW)["ranks"] == \
        {"1": {"step": 4, "phase": "train"}}
    # until its second row a rank has slow_phase_s (its first row may come before compiling)
    assert watch.judge({0: rec(1, 30.0, "first")}, FIVE, None, NOW) is None
    assert watch.judge({0: rec(1, 61.0, "first")}, FIVE, None, NOW) is not None
    # auto: 20 x the slowest rank's time per logged step, at least slow_phase_s (a script's evaluation logs
    # nothing, and expgpu cannot see it)
    assert watch.judge({0: rec(5, 599.0, step_s=0.1)}, AUTO, None, NOW) is None
    assert watch.judge({0: rec(5, 601.0, step_s=0.1)}, AUTO, None, NOW) is not None
    assert watch.judge({0: rec(5, 1100.0, step_s=60.0), 1: rec(5, 1100.0, step_s=0.1)}, AUTO, None, NOW) is None
    assert watch.judge({0: rec(5, 1201.0, step_s=60.0), 1: rec(5, 1201.0, step_s=0.1)}, AUTO, None, NOW)


def test_a_script_that_logs_nothing_is_watched_by_its_output_alone_and_only_when_asked():
    silent = {0: rec(phase="start", moved_ago=5000.0, output_ago=5000.0),
              1: rec(phase="start", moved_ago=5000.0, output_ago=5000.0)}
    assert watch.judge(silent, AUTO, None, NOW) is None          # nothing says that it logs: no step limit
    verdict = watch.judge(silent, AUTO, 30.0, NOW)               # task.output_timeout_s=30
    assert (verdict["sign"], verdict["behind"], verdict["step"], verdict["ranks"]["0"]) == \
        ("output", [0, 1], None, {"phase": "start"})
    # one rank printing holds the verdict, however quiet the others (rank 0 prints, as scripts do)
    assert watch.judge({0: rec(phase="start", output_ago=2.0), 1: rec(phase="start", output_ago=5000.0)},
                       AUTO, 30.0, NOW) is None
    # a rank that shows either watched sign in time is not past its limit
    assert not watch.past(rec(7, 100.0, output_ago=1.0), FIVE, 30.0, NOW, logging=True)
    assert not watch.past(rec(7, 1.0, output_ago=100.0), FIVE, 30.0, NOW, logging=True)
    assert watch.past(rec(7, 100.0, output_ago=100.0), FIVE, 30.0, NOW, logging=True)
    assert not watch.past(rec(phase="start", moved_ago=1e6), FIVE, None, NOW, logging=False)   # nothing watched


def test_a_rank_that_never_logs_holds_the_verdict_for_slow_phase_s_then_its_peer_that_logs_decides():
    # rows are rank 0's (its script logs on rank 0 only): rank 1 is watched by steps from its start, with
    # slow_phase_s, because a rank of the world logged
    assert watch.judge({0: rec(9, 6.0), 1: rec(phase="start", moved_ago=30.0)}, FIVE, None, NOW) is None
    verdict = watch.judge({0: rec(9, 6.0), 1: rec(phase="start", moved_ago=61.0)}, FIVE, None, NOW)
    assert verdict["behind"] == [0, 1] and verdict["ranks"]["1"] == {"phase": "start"}


def test_the_line_names_the_rank_behind_the_step_it_logged_last_and_where_it_is():
    verdict = watch.judge({0: rec(9, 6.0), 1: rec(4, 7.5)}, FIVE, None, NOW)
    frames = {1: {"own": "train.py:30 in get_batch: time.sleep(3600)"},
              0: {"own": "train.py:50 in step: dist.all_reduce(t)", "inside": "torch's all_reduce"}}
    from expgpu.procs.hang_rules import culprits, line

    named = culprits(verdict, frames)
    assert named == [1]
    assert line(verdict, frames, head=watch.head(verdict, named)) == (
        "rank 1 has logged no step after step 4 for 8 s (limit 5 s); rank 1 at train.py:30 in get_batch: "
        "time.sleep(3600); the others (rank 0) wait in torch's all_reduce at train.py:50 in step: dist.all_reduce(t)")
    # all at one step: the one not waiting in a collective is named, by its frame
    both = watch.judge({0: rec(9, 6.0), 1: rec(9, 6.0)}, FIVE, None, NOW)
    frames[1] = {"own": "train.py:30 in get_batch: time.sleep(3600)"}
    assert culprits(both, frames) == [1]
    assert line(both, frames, head=watch.head(both, [1])).startswith("rank 1 has logged no step after step 9 for 6 s")
    # nothing tells them apart: every rank, and no rank's step
    unknown = {r: {"own": None, "unknown": "an unknown place (no py-spy on PATH to read it; it wrote no output)"}
               for r in (0, 1)}
    assert line(both, unknown, head=watch.head(both, [0, 1])) == (
        "no rank has logged a step after step 9 for 6 s (limit 5 s); rank 0 at an unknown place (no py-spy on PATH "
        "to read it; it wrote no output); rank 1 at an unknown place (no py-spy on PATH to read it; it wrote no "
        "output)")
    output = watch.judge({0: rec(phase="start", output_ago=40.0)}, AUTO, 30.0, NOW)
    assert watch.head(output, [0]) == "rank 0 has written no output"


def test_the_heartbeat_is_what_expgpu_log_wrote_with_no_call_to_the_os(tmp_path):
    beat_file = Heartbeat()
    try:
        assert beat_file.read() == (0, 0)
        beat = Beat.from_env(beat_file.env())
        beat.beat(5)
        assert beat_file.read() == (1, 5)
        beat.beat(5)                       # the same step again (a second name logged at it): no move
        assert beat_file.read() == (1, 5)
        beat.beat(None)                    # no step=: the one after the last
        beat.beat(7)
        assert beat_file.read() == (3, 7)
        assert Beat.from_env({}) is None and Beat.from_env({"EXPGPU_SCRIPT_HEARTBEAT": str(tmp_path / "x")}) is None
    finally:
        beat_file.close()
    assert not Path(beat_file.path).exists()


def test_py_spy_json_gives_the_frame_of_the_scripts_main_thread():
    probe = str(REPO / "tests" / "scripts" / "probe_script.py")
    sleeps = next(n for n, ln in enumerate(Path(probe).read_text().splitlines(), 1) if "time.sleep(3600)" in ln)
    dump = [{"thread_name": "pt_autograd_0", "os_thread_id": 11, "frames": [
                {"filename": threading.__file__, "line": 320, "name": "Condition.wait"}]},
            {"thread_name": "MainThread", "os_thread_id": 10, "frames": [
                {"filename": threading.__file__, "line": 320, "name": "Condition.wait"},
                {"filename": probe, "line": sleeps, "name": "<module>"}]}]
    frame = stacks.frame_of_dump(dump, 10)
    assert frame == {"own": f"probe_script.py:{sleeps} in <module>: time.sleep(3600)", "inside": "Condition.wait"}
    assert stacks.frame_of_dump("not json", 10) is None and stacks.frame_of_dump([], 10) is None


# --- real runs: tests/scripts/probe_script.py under expgpu's spawn ---------------------------------------------

def _hung_line(run) -> str:
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("expgpu:")]
    assert lines and lines[-1].startswith("expgpu: hung: "), run.stderr
    return lines[-1]


def _nothing_left(run_dir: Path) -> None:
    """No process of the run is left: not the scripts (their pids), not anything working in the run dir."""
    for path in run_dir.glob("started-rank*.json"):
        pid = json.loads(path.read_text())["pid"]
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    for proc in psutil.process_iter(["pid"]):
        try:
            assert proc.cwd() != str(run_dir), proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_whose_logged_step_stops_is_named_with_its_step_and_stacks_and_the_run_exits_124(tmp_path):
    run = expgpu([*CONF, "task=script_probe", "launch.nproc_per_node=2", "task.args.log=true",
                  "task.args.steps=20", "task.args.step-s=0.2", "task.args.print-steps=true", "task.args.hang-at=4",
                  "task.args.hang-rank=1", "launch.hang.timeout_s=4"], tmp_path / "run")
    ended = time.time()
    assert run.returncode == EXIT_HUNG, run.stderr
    hung_at = json.loads((run.run_dir / "hung-rank1").read_text())["at"]
    assert ended - hung_at < 4 + 5, ended - hung_at            # within the limit and 5 s
    said = _hung_line(run)
    assert said.startswith("expgpu: hung: rank 1 has logged no step after step 4 for "), said
    assert "(limit 4 s); rank 1 at " in said and said.endswith(f"(every rank's stacks: {run.run_dir / 'hang'})")
    verdict = json.loads((run.run_dir / "hang" / "verdict.json").read_text())
    assert verdict["culprits"] == [1] and said.startswith(f"expgpu: hung: {verdict['line']}")
    stack = (run.run_dir / "hang" / "rank1.txt").read_text()
    assert stack.startswith("rank 1's script (pid ") and "step last logged 4" in stack
    assert stack.rstrip().endswith("rank 1: step 4")          # its last lines of output
    if stacks.has_spy():   # its stack, and the line says where it sleeps
        assert 'Thread' in stack and '"MainThread"' in stack and "probe_script.py" in stack
        assert "rank 1 at probe_script.py:" in said and "time.sleep(3600)" in said
    else:
        assert "rank 1 at an unknown place (no py-spy on PATH to read it; its last output: 'rank 1: step 4')" in said
    res = run.result
    assert (res["status"], res["exit_codes"], res["hang"]["culprits"], res["steps"]) == ("hung", [0, 143], [1], 4)
    assert res["attempts"][-1]["kind"] == "hung" and res["attempts"][-1]["reason"] == verdict["line"]
    _nothing_left(run.run_dir)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_that_logs_nothing_and_stops_printing_is_hung_after_task_output_timeout_s(tmp_path):
    run = expgpu([*CONF, "task=script_probe", "launch.nproc_per_node=2", "task.args.steps=400",
                  "task.args.step-s=0.2", "task.args.print-steps=true", "task.args.hang-at=3",
                  "task.output_timeout_s=3"], tmp_path / "run")
    ended = time.time()
    assert run.returncode == EXIT_HUNG, run.stderr
    hung_at = min(json.loads((run.run_dir / f"hung-rank{r}").read_text())["at"] for r in (0, 1))
    assert ended - hung_at < 3 + 5, ended - hung_at
    said = _hung_line(run)
    assert said.startswith("expgpu: hung: no rank has written output for "), said
    assert "(limit 3 s); rank 0 at " in said and "; rank 1 at " in said
    for rank in (0, 1):
        assert (run.run_dir / "hang" / f"rank{rank}.txt").read_text().rstrip().endswith(f"rank {rank}: step 3")
    assert run.result["status"] == "hung" and run.result["hang"]["sign"] == "output"
    _nothing_left(run.run_dir)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_that_prints_slowly_but_steadily_is_not_hung(tmp_path):
    run = expgpu([*CONF, "task=script_probe", "launch.nproc_per_node=2", "task.args.steps=5",
                  "task.args.step-s=1.2", "task.args.print-steps=true", "task.output_timeout_s=3",
                  "launch.hang.timeout_s=3"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert run.result["status"] == "finished" and not (run.run_dir / "hang").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hung_script_restarts_under_on_hang_restart_with_its_resume_args(tmp_path):
    run = expgpu([*CONF, "task=script_probe_resume", "launch.nproc_per_node=2", "task.args.steps=12",
                  "task.args.log=true", "task.args.save-every=1", "task.args.hang-at=4", "task.args.hang-rank=1",
                  "task.args.hang-once=true", "launch.hang.timeout_s=3", "launch.on_hang=restart",
                  "launch.max_restarts=1"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    said = [ln for ln in run.output.splitlines() if "restart 1 of 1: hung at step 4 (rank 1 has logged no step" in ln]
    assert len(said) == 1, run.output
    res = run.result
    assert (res["status"], res["resumed"], res["attempt"]) == ("finished", True, 1)
    assert [a["kind"] for a in res["attempts"]] == ["hung", "finished"] and res["attempts"][0]["ranks"] == [1]
    assert json.loads((run.run_dir / "hang-1" / "verdict.json").read_text())["culprits"] == [1]
    assert json.loads((run.run_dir / "hang-1" / "result.json").read_text())["status"] == "hung"
    assert json.loads((run.run_dir / "started-rank1.json").read_text())["argv"][-1] == "--resume"


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_a_bad_output_timeout_is_one_line_and_exit_2(tmp_path, value):
    run = expgpu([*CONF, "task=script_probe", f"task.output_timeout_s={value}"], tmp_path / "run")
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("expgpu:")]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith(f"expgpu: error: task.output_timeout_s={value!r} is not allowed: null ("
                               if value == "abc" else f"expgpu: error: task.output_timeout_s={value} is not allowed")
