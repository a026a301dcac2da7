"""The hang watchdog (expgpu.train.watchdog): its verdict on the ranks' records and the line it says, in
this process; then real 2-rank runs over gloo whose rank 1 sleeps, spins or waits in a collective its
peer never calls, and runs that are slow but not hung."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from conftest import HELPERS, TESTS, clean_env, expgpu
from expgpu.errors import EXIT_HUNG
from expgpu.procs.stacks import has_spy
from expgpu.train import watchdog
from expgpu.train.watchdog import HangSettings

FIVE = HangSettings(timeout_s=5.0, slow_phase_s=60.0)
AUTO = HangSettings(timeout_s=None, slow_phase_s=600.0)


def rec(step, age, phase="train", step_s=0.01):
    return {"step": step, "age": age, "phase": phase, "step_s": step_s}


def test_a_hang_is_every_training_rank_past_its_limit():
    assert watchdog.judge({0: rec(5, 6.0), 1: rec(5, 4.0)}, FIVE) is None   # rank 1 moved 4 s ago
    verdict = watchdog.judge({0: rec(6, 6.0), 1: rec(5, 7.5)}, FIVE)
    assert verdict["behind"] == [1] and verdict["step"] == 6 and verdict["waited_s"] == 7.5
    # a rank in a slow phase (saving, evaluating, its first step) has slow_phase_s, and holds the verdict
    assert watchdog.judge({0: rec(5, 30.0), 1: rec(5, 30.0, "checkpoint")}, FIVE) is None
    assert watchdog.judge({0: rec(5, 30.0), 1: rec(5, 30.0, "evaluation")}, FIVE) is None
    assert watchdog.judge({0: rec(5, 61.0), 1: rec(5, 61.0, "evaluation")}, FIVE) is not None
    # its own code outside run.steps (an evaluation between epochs, not in a run.phase) is a slow phase too
    assert watchdog.judge({0: rec(5, 59.0, "outside the steps"), 1: rec(5, 59.0, "outside the steps")}, FIVE) \
        is None
    # ranks whose loop has not begun (setup, or a task without run.steps) hold no verdict alone, only beside
    # a rank whose loop began, with slow_phase_s
    assert watchdog.judge({0: rec(0, 5000.0, "setup"), 1: rec(0, 5000.0, "setup")}, FIVE) is None
    assert watchdog.judge({0: rec(0, 30.0, "first step"), 1: rec(0, 30.0, "setup")}, FIVE) is None
    assert watchdog.judge({0: rec(0, 61.0, "first step"), 1: rec(0, 61.0, "setup")}, FIVE)["behind"] == [0, 1]
    # a rank that is done (waiting for its peers at the end) is no hang of its own
    assert watchdog.judge({0: rec(20, 100.0, "done"), 1: rec(12, 3.0)}, FIVE) is None
    assert watchdog.judge({0: rec(20, 100.0, "done"), 1: rec(12, 6.0)}, FIVE)["behind"] == [1]


def test_auto_is_twenty_of_the_slowest_ranks_step_time_and_never_below_50_s():
    assert watchdog.limit(AUTO, "train", 0.01) == watchdog.FLOOR_S == 50.0
    assert watchdog.limit(AUTO, "train", 10.0) == 200.0                   # a slow model is not a hang
    assert watchdog.limit(AUTO, "first step", 0.01) == 600.0
    assert watchdog.judge({0: rec(5, 150.0, step_s=10.0), 1: rec(5, 150.0, step_s=0.5)}, AUTO) is None
    assert watchdog.judge({0: rec(5, 201.0, step_s=10.0), 1: rec(5, 201.0, step_s=0.5)}, AUTO) is not None


def test_the_line_names_the_rank_at_fault_by_its_own_frame_and_where_the_others_wait():
    verdict = watchdog.judge({0: rec(5, 6.0), 1: rec(5, 6.0)}, FIVE)
    frames = {0: {"own": "train.py:40 in train: loss.backward()", "inside": "torch's _engine_run_backward"},
              1: {"own": "train.py:30 in train: time.sleep(3600)"}}
    assert watchdog.culprits(verdict, frames) == [1]   # all at one step: the one not waiting in a collective
    assert watchdog.line(verdict, frames) == (
        "rank 1 has not finished step 6 for 6 s (limit 5 s); rank 1 at train.py:30 in train: time.sleep(3600); "
        "the others (rank 0) wait in torch's _engine_run_backward at train.py:40 in train: loss.backward()")
    # every rank waiting in a collective (one the others never call): all named, each where it is
    both = {0: frames[0], 1: {"own": "train.py:33 in train: dist.barrier()", "inside": "torch's barrier"}}
    assert watchdog.line(verdict, both).startswith("no rank has finished step 6 for 6 s (limit 5 s); rank 0 at ")
    assert "rank 1 at train.py:33 in train: dist.barrier() (in torch's barrier)" in watchdog.line(verdict, both)
    # a rank whose watchdog could not say where it is (a C call holding the GIL)
    assert "rank 1 at an unknown place (its watchdog could not run" in watchdog.line(verdict, {0: frames[0]})
    # a run of one rank: that rank, by name
    alone = watchdog.judge({0: rec(5, 6.0)}, FIVE)
    assert watchdog.line(alone, {0: frames[1]}) == \
        "rank 0 has not finished step 6 for 6 s (limit 5 s); rank 0 at train.py:30 in train: time.sleep(3600)"


def test_a_rank_that_ended_while_others_went_on_is_at_fault_after_ten_seconds():
    # rank 1's task returned after step 12; rank 0 went on into step 13, where it waits for it
    ended = {0: rec(12, 11.0), 1: rec(12, 11.0, "ended")}
    verdict = watchdog.judge(ended, AUTO)
    assert (verdict["ended"], verdict["went_on"], verdict["step"], verdict["limit_s"]) == ([1], [0], 12, 10.0)
    assert watchdog.culprits(verdict, {}) == [1]
    frames = {0: {"own": "train.py:40 in train: loss.backward()", "inside": "torch's _engine_run_backward"}}
    assert watchdog.line(verdict, frames) == (
        "rank 1 ended its task after step 12 (returned, or sys.exit(0)) while rank 0 went on, and has waited 11 s "
        "(limit 10 s) in step 13, in torch's _engine_run_backward at train.py:40 in train: loss.backward(): every "
        "rank must leave run.steps at the same step (decide an early stop on every rank, e.g. on a run.all_reduce'd "
        "value, not on one rank alone)")
    # a break (return, sys.exit(0)) inside step 6's body, before its all-reduce: that step counts as done on rank 1,
    # and rank 0 waits inside it
    broke = watchdog.judge({0: rec(5, 11.0), 1: rec(6, 11.0, "ended in a step")}, AUTO)
    assert (broke["ended"], broke["step"], broke["at"]) == ([1], 6, 6)
    assert watchdog.line(broke, frames).startswith(
        "rank 1 ended its task in step 6 (a break, return or sys.exit(0) in run.steps) while rank 0 went on, and has "
        "waited 11 s (limit 10 s) in step 6, in torch's")
    assert watchdog.judge({0: rec(4, 30.0), 1: rec(6, 11.0, "ended in a step")}, AUTO) is None   # behind: not it
    # its data ran out (an iterable of its own, sharded unevenly), or its max_steps were fewer: said so, whether its
    # task has returned since or it is still in its own code after the loop (watched there as a slow phase)
    for phase in ("data ran out", "ended: data ran out"):
        out = watchdog.judge({0: rec(12, 11.0), 1: rec(12, 11.0, phase)}, AUTO)
        assert watchdog.line(out, frames).startswith(
            "rank 1 ran out of data after step 12 (its loader ended) while rank 0 went on, and has waited 11 s "), out
        assert watchdog.line(out, frames).endswith(
            "every rank must run the same number of steps: give each the same number of batches (run.loader shares a "
            "dataset out equally; an iterable of your own must yield as many on every rank)")
    fewer = watchdog.judge({0: rec(12, 11.0), 1: rec(12, 1.0, "max_steps done")}, AUTO)
    assert "rank 1 did its max_steps (12) while rank 0 went on" in watchdog.line(fewer, frames)
    # still in its own code after the loop for its slow phase, with its peers done: the usual verdict
    assert watchdog.judge({0: rec(20, 601.0, "ended"), 1: rec(20, 601.0, "max_steps done")}, AUTO)["behind"] == [1]
    assert watchdog.judge({0: rec(12, 9.0), 1: rec(12, 11.0, "done")}, AUTO) is None   # 10 s: not yet
    assert watchdog.judge({0: rec(12, 11.0, step_s=1.0), 1: rec(12, 0.0, "ended")}, AUTO) is None   # 20 x 1 s
    assert watchdog.judge(ended, FIVE)["limit_s"] == 5.0   # launch.hang.timeout_s, where set
    # the normal end: a rank still in its last step (behind the end), or saving after it, is no one's fault
    assert watchdog.judge({0: rec(11, 30.0), 1: rec(12, 30.0, "ended")}, AUTO) is None
    assert watchdog.judge({0: rec(12, 30.0, "checkpoint"), 1: rec(12, 30.0, "ended")}, AUTO) is None
    # behind the end for its limit: the usual verdict, the rank behind at fault
    assert watchdog.judge({0: rec(11, 51.0), 1: rec(12, 51.0, "ended")}, AUTO)["behind"] == [0]


def test_a_rank_done_after_its_data_ran_out_still_says_so_to_its_peers(tmp_path):
    # done() after the task returned: the record keeps why its steps ended (the peers' verdict names it), and the
    # step it ended at, not its last tick's
    from torch.distributed import HashStore

    store, where = HashStore(), [(3, "train")]
    dog = watchdog.start(store, 0, 1, tmp_path, AUTO, lambda: where[0], lambda verdict, text: None)
    where[0] = (12, "ended: data ran out")
    dog.done()
    record = json.loads(store.get(f"{watchdog.PREFIX}/hb/0"))
    assert (record["step"], record["phase"]) == (12, "ended: data ran out")
    where[0] = (12, "train")   # a run stopped by a signal: its loop is over, nothing more to say
    stopped = watchdog.start(store, 0, 1, tmp_path, AUTO, lambda: where[0], lambda verdict, text: None)
    stopped.done()
    assert json.loads(store.get(f"{watchdog.PREFIX}/hb/0"))["phase"] == "done"


def _hang(tmp_path, how: str, *extra: str, timeout: float = 120, nproc: int = 2):
    args = ["--config-dir", str(TESTS / "conf"), "task=probe_hangs", f"task.how={how}",
            f"launch.nproc_per_node={nproc}", "launch.hang.timeout_s=5", *extra]
    if nproc == 1:
        args.append("task.rank=0")
    t0 = time.monotonic()
    run = expgpu(args, tmp_path / "run", env=clean_env(PYTHONPATH=str(HELPERS)), timeout=timeout)
    return run, time.monotonic() - t0


def _at(code: str) -> str:
    """How the line names the probe's line that holds `code`: hang_probe.py:<n> in hangs: <code>."""
    lines = (HELPERS / "hang_probe.py").read_text().splitlines()
    n = next(i for i, text in enumerate(lines, 1) if text.strip() == code)
    return f"hang_probe.py:{n} in hangs: {code}"


def _leftovers(run_dir) -> list:
    """Processes that still hold a file of the run dir open (a rank that outlived the run)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if any(str(run_dir) in f.path for f in p.open_files()):
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sleeping_rank_is_named_with_its_line_within_the_timeout_and_nothing_outlives_it(tmp_path):
    run, took = _hang(tmp_path, "sleep")
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == EXIT_HUNG, run.stderr[-3000:]
    assert last.startswith("expgpu: hung: rank 1 has not finished step 6 for ") and \
        f"rank 1 at {_at('time.sleep(3600)')}" in last, last
    assert "the others (rank 0) wait in torch's _engine_run_backward" in last
    stacks = {r: (run.run_dir / "hang" / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert "time.sleep(3600)" in stacks[1] and "loss.backward()" in stacks[0]
    if has_spy():   # 'expgpu[hang]' (in the dev extra): every thread's native frames too
        assert "--- native stacks (py-spy dump --native) ---" in stacks[1] and "Thread " in stacks[1].split(
            "--- native stacks")[1], stacks[1][-3000:]
    verdict = json.loads((run.run_dir / "hang" / "verdict.json").read_text())
    assert verdict["culprits"] == [1] and run.result["status"] == "hung" and run.result["hang"]["culprits"] == [1]
    # the timeout (5 s) and the launch's start-up (a few seconds on 2 busy cores), no collective timeout
    assert took < run.result.get("timing", {}).get("startup_s", 0) + 5 + 5 + 20, took
    assert _leftovers(run.run_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_of_one_rank_that_stops_making_progress_ends_with_its_line_and_frees_its_gpu(tmp_path):
    # no process group, no collective's timeout: before the watchdog watched one rank, this ran for ever
    run, took = _hang(tmp_path, "sleep", nproc=1)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == EXIT_HUNG, run.stderr[-3000:]
    assert last == (f"expgpu: hung: rank 0 has not finished step 6 for 5 s (limit 5 s); rank 0 at "
                    f"{_at('time.sleep(3600)')} (every rank's stacks: {run.run_dir / 'hang'})"), last
    assert "time.sleep(3600)" in (run.run_dir / "hang" / "rank0.txt").read_text()
    assert run.result["status"] == "hung" and run.result["hang"]["culprits"] == [0]
    assert took < 5 + 30, took
    assert _leftovers(run.run_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how,extra", [
    ("phase", ["task.slow_s=8"]),                          # an evaluation longer than the limit, in run.phase
    ("after", ["task.slow_s=8"]),                          # an evaluation after run.steps, not in run.phase
])
def test_slow_is_not_hung_on_one_rank_either(tmp_path, how, extra):
    run, _ = _hang(tmp_path, how, "task.max_steps=8", *extra, nproc=1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["status"] == "finished" and not (run.run_dir / "hang").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how,says", [
    ("spin", ["rank 1 has not finished step 6 for ", f" s (limit 5 s); rank 1 at {_at('while True:')}"]),
    ("collective", ["no rank has finished step 6 for ", f" s (limit 5 s); rank 0 at {_at('loss.backward()')} "
                    f"(in torch's _engine_run_backward); rank 1 at {_at('torch.distributed.barrier()')} "
                    "(in torch's barrier)"]),
])
def test_a_spinning_rank_and_a_collective_nobody_else_calls_are_named(tmp_path, how, says):
    run, _ = _hang(tmp_path, how)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == EXIT_HUNG and all(part in last for part in says), run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", ["break", "return", "exit"])
def test_an_early_stop_on_one_rank_names_that_rank_within_seconds_not_the_one_that_waits(tmp_path, stop):
    # `if run.is_main and ...: break`: rank 0 would wait in its next step's all-reduce until the collective's
    # timeout (300 s), and the error would then name rank 0; the default watchdog (auto) says it in ~10 s
    t0 = time.monotonic()
    run = expgpu(["--config-dir", str(TESTS / "conf"), "task=probe_hangs", "task.how=stop", f"task.stop={stop}",
                  "launch.nproc_per_node=2"], tmp_path / "run", env=clean_env(PYTHONPATH=str(HELPERS)), timeout=120)
    took = time.monotonic() - t0
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == EXIT_HUNG, run.stderr[-3000:]
    assert last.startswith("expgpu: hung: rank 1 ended its task in step 6 (a break, return or sys.exit(0) in "
                           "run.steps) while rank 0 went on, and has waited "), last
    assert f"in step 6, in torch's _engine_run_backward at {_at('loss.backward()')}" in last
    assert "every rank must leave run.steps at the same step" in last
    assert run.result["status"] == "hung" and run.result["hang"]["culprits"] == [1]
    assert took < run.result.get("timing", {}).get("startup_s", 0) + 10 + 5 + 30, took
    assert _leftovers(run.run_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_whose_data_ran_out_first_is_named(tmp_path):
    run, _ = _hang(tmp_path, "uneven")
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == EXIT_HUNG, run.stderr[-3000:]
    assert last.startswith("expgpu: hung: rank 1 ran out of data after step 5 (its loader ended) while rank 0 went "
                           "on, and has waited "), last
    assert last.split(" (every rank's stacks")[0].endswith("an iterable of your own must yield as many on every rank)")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_whose_process_ended_early_with_code_0_is_named_not_the_peer_that_lost_it(tmp_path):
    run, took = _hang(tmp_path, "stop", "task.stop=os_exit")
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1, run.stderr[-3000:]
    assert last.startswith("expgpu: rank 1 failed: its process ended (code 0) while rank 0 still trained"), last
    assert "its task ended on that rank alone (an early exit decided there" in last and "/gloo/" not in last


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sys_exit_0_in_the_task_of_one_rank_is_its_end(tmp_path):
    run, _ = _hang(tmp_path, "stop", "task.stop=exit", nproc=1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["status"] == "finished" and run.result["steps"] == 6   # the step whose body exited: done
    assert "the task called sys.exit(0): taken as its end" in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how,extra", [
    ("slow", ["task.slow_s=4", "task.step_s=0.3"]),       # one step 13x the others, under the 5 s limit
    ("phase", ["task.slow_s=8"]),                          # an evaluation longer than the limit, in run.phase
    ("save", ["task.slow_s=8", "checkpoint.every_steps=4"]),   # a checkpoint save longer than the limit
    ("setup", ["task.slow_s=8"]),                          # rank 1 builds while rank 0 waits in run.barrier()
    ("after", ["task.slow_s=8"]),                          # an evaluation after run.steps, not in run.phase
])
def test_slow_is_not_hung(tmp_path, how, extra):
    run, _ = _hang(tmp_path, how, "task.max_steps=8", *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["status"] == "finished" and not (run.run_dir / "hang").exists()


def test_a_collective_that_timed_out_names_the_ranks_it_waited_for_by_their_records():
    from expgpu.errors import timed_out
    from expgpu.procs.hang_rules import held_up

    error = "RuntimeError: Timed out waiting 5000ms for recv operation to complete"
    # rank 0 in a step of its own (behind rank 1's), rank 2 waiting beside rank 1: rank 0 alone is named
    said = held_up({0: rec(5, 9.0), 1: rec(6, 0.5), 2: rec(6, 0.4)}, me=1, timeout_s=5, error=error)
    assert said.startswith("its collective in step 7 timed out after backend.timeout_s=5 s waiting for rank 0: rank 0 "
                           "was still in step 6, for 9 s (RuntimeError: Timed out waiting 5000ms for recv operation "
                           "to complete): work one rank does alone (an evaluation, a save or a download on rank 0 "
                           "only) must end within backend.timeout_s while the others wait: raise it above")
    # all at one step: the ranks outside a step (an evaluation in run.phase, their own code, a save)
    said = held_up({0: rec(6, 8.0, "evaluation"), 1: rec(6, 8.0), 2: rec(6, 8.0, "outside the steps")}, 1, 300, error)
    assert said.startswith("its collective in step 7 timed out after backend.timeout_s=300 s waiting for rank 0 and "
                           "rank 2: rank 0 was in its evaluation after step 6, for 8 s; rank 2 was in its own code "
                           "outside run.steps after step 6, for 8 s (")
    assert "rank 0 was done with its steps after step 6 (ended)" in held_up({0: rec(6, 3.0, "ended"), 1: rec(7, 5.0)},
                                                                             1, 5, error)
    # nobody behind, or nothing known of the others: nothing to add to the error
    assert held_up({0: rec(6, 8.0), 1: rec(6, 8.0)}, 1, 5, error) is None
    assert held_up({0: rec(0, 8.0, "first step"), 1: rec(0, 8.0, "setup")}, 1, 5, error) is None
    # a rank still in its setup: behind a collective of the setup (run.wrap's, a barrier), and behind the first step
    assert held_up({0: rec(0, 8.0, "setup"), 1: rec(0, 8.0, "setup")}, 1, 5, error).startswith(
        "its collective before run.steps (in its setup) timed out after backend.timeout_s=5 s waiting for rank 0: "
        "rank 0 was still in its setup (its own code before run.steps), for 8 s (")
    assert held_up({0: rec(0, 8.0, "setup"), 1: rec(0, 8.0, "setup")}, 1, 5, error).endswith(
        "raise it above that work's length, or do it before the launch (a download, a dataset's preparation: a step "
        "of its own)")
    assert held_up({0: rec(0, 8.0, "setup"), 1: rec(0, 5.0, "first step")}, 1, 5, error).startswith(
        "its collective in step 1 timed out after backend.timeout_s=5 s waiting for rank 0: rank 0 was still in its "
        "setup")
    for text in (error, "DistBackendError: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, ...)",
                 "Rank 1 failed to pass monitoredBarrier in 5000 ms", "wait timeout after 300000ms, keys: /x"):
        assert timed_out(RuntimeError(text)), text
    assert not timed_out(RuntimeError("Connection closed by peer"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_collective_timeout_names_the_rank_whose_work_alone_outlasted_it_not_only_the_rank_that_waited(tmp_path):
    """Rank 1 evaluates alone in run.phase (a slow phase, which the watchdog allows) past backend.timeout_s: rank
    0's collective times out, and its line names rank 1 and where it was, where it used to blame only itself."""
    # 8 s: a loaded machine's start-up skew between the ranks stays well under it (every collective has it)
    run, took = _hang(tmp_path, "alone", "task.slow_s=60", "backend.timeout_s=8")
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.output.strip().splitlines()[-1]
    assert last.startswith("expgpu: rank 0 failed: its collective in step 6 timed out after backend.timeout_s=8 s "
                           "waiting for rank 1: rank 1 was in its evaluation after step 5, for "), last
    assert "raise it above that work's length" in last and took < 60


@pytest.mark.slow
@pytest.mark.parametrize("how, where", [("setup", "before run.steps (in its setup)"), ("late", "in step 1")])
def test_a_collective_timeout_names_the_rank_still_in_its_setup(tmp_path, how, where):
    """Rank 1 builds alone before run.steps (a download on one rank) past backend.timeout_s: rank 0's collective
    in its own setup (run.barrier) or in its first step (no collective in the setup) names rank 1, in its setup."""
    run, took = _hang(tmp_path, how, "task.slow_s=60", "backend.timeout_s=8")
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.output.strip().splitlines()[-1]
    assert last.startswith(f"expgpu: rank 0 failed: its collective {where} timed out after backend.timeout_s=8 s "
                           "waiting for rank 1: rank 1 was still in its setup (its own code before run.steps), "
                           "for "), last
    assert took < 60


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_crashes_during_an_async_save_stops_its_peers_at_once_and_keeps_the_last_checkpoint(tmp_path):
    """Rank 1 raises at step 5, while the background save of step 4 is being written (faults.slow_write_s:
    30 s): its process is slow to end (the writer's thread), and its peer would wait in its next collective
    until then. The watchdog stops the peer within seconds; the save of step 2 stays in place, whole."""
    args = ["task=a", "task.max_steps=40", "launch.wrap=fsdp", "launch.nproc_per_node=2", "backend.timeout_s=120",
            "checkpoint.every_steps=2", "checkpoint.async_save=true"]
    run = expgpu([*args, "faults.slow_write_s=30", "faults.crash_rank=1", "faults.crash_step=5"], tmp_path / "run",
                 timeout=240)
    ended = time.time()
    assert run.returncode == 1 and "rank 1 failed: RuntimeError: injected crash" in run.stderr, run.stderr[-3000:]
    crashed = (tmp_path / "run" / ".expgpu" / "rank1.failure.json").stat().st_mtime
    assert ended - crashed < 15, ended - crashed   # the write in flight would hold it 30 s more
    resumed = expgpu([*args, "task.max_steps=6"], tmp_path / "run")
    assert resumed.returncode == 0 and resumed.result["resumed_from_step"] == 2, resumed.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_crashed_rank_whose_process_lingers_stops_its_peers_at_once_under_torchrun(tmp_path):
    """Rank 1 raises, and a thread of its own keeps its process alive 90 s more (the interpreter waits for
    it at exit): without the watchdog its peer waits in the gradients' all-reduce until then (torchrun
    only acts once a process ends). With it, the peer stops within seconds of the crash."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "expgpu"]
    run = expgpu(["--config-dir", str(TESTS / "conf"), "task=probe_hangs", "task.how=crash", "task.slow_s=90",
                  "backend.timeout_s=120", "launch.hang.timeout_s=5"], tmp_path / "run", cmd=cmd,
                 env=clean_env(PYTHONPATH=str(HELPERS)), timeout=200)
    assert run.returncode != 0 and "rank 1 crashed at step 5" in run.stderr, run.stderr[-3000:]
    started = _logged_at(run.output, "rank 1/2 on ")          # the crash comes 5 short steps later
    stopped = _logged_at(run.output, "rank 0: stopping: rank(s) 1 failed")
    assert stopped - started < 10, (started, stopped)


def _logged_at(text: str, what: str) -> float:
    """The time of the first log line holding `what` ([2026-01-31 12:00:00,123][expgpu][...] - ...)."""
    import datetime

    line = next(line for line in text.splitlines() if what in line)
    return datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sweeps_report_says_which_job_hung_and_why(tmp_path):
    """The sweep goes on past a hung job; its report shows it as hung (not failed), with the watchdog's line
    and where the stacks are."""
    from conftest import multirun

    sweep = tmp_path / "sweep"
    run = multirun(["--config-dir", str(TESTS / "conf"), "task=probe_hangs", "task.how=sleep,none",
                    "launch.nproc_per_node=2", "launch.hang.timeout_s=5"], sweep,
                   env=clean_env(PYTHONPATH=str(HELPERS)), timeout=200)
    assert "expgpu: hung: rank 1 has not finished step 6" in run.stderr, run.stderr[-3000:]
    report = subprocess.run([sys.executable, "-m", "expgpu.report", str(sweep)], capture_output=True, text=True,
                            timeout=120)
    rows = {line.split()[1]: line.split() for line in report.stdout.splitlines() if line[:1] in "-1" and
            len(line.split()) > 3 and line.split()[1] in "01"}
    assert rows["0"][2] == "hung" and rows["1"][2] == "finished", report.stdout
    assert f"job 0: rank 1 has not finished step 6 for 5 s (limit 5 s); rank 1 at {_at('time.sleep(3600)')}" \
        in report.stdout and f"(every rank's stacks: {sweep / '0' / 'hang'})" in report.stdout, report.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_pool_sweep_goes_on_past_a_trial_of_one_rank_that_hung_and_its_slot_runs_the_next(tmp_path):
    from conftest import multirun

    sweep = tmp_path / "sweep"
    run = multirun(["--config-dir", str(TESTS / "conf"), "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=1",
                    "task=probe_hangs", "task.how=sleep,none,none", "task.rank=0", "launch.hang.timeout_s=5"], sweep,
                   env=clean_env(PYTHONPATH=str(HELPERS)), timeout=150)
    assert run.returncode == 1 and "expgpu: the sweep failed" in run.stderr, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "#0 failed after" in output and "exited with code 124 (expgpu: hung: rank 0 has not finished step 6" \
        in output, output[-3000:]
    statuses = [json.loads((sweep / str(n) / "result.json").read_text())["status"] for n in range(3)]
    assert statuses == ["hung", "finished", "finished"]   # on the one slot, after the hung trial
