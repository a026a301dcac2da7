"""Stop requests: in this process (which signal wins, a second Ctrl-C, a stop at a step:
expgpu.procs.stop_signals), then the stop poll on a real 2-rank gloo group (expgpu.train.agreement):
same steps on every rank, an adaptive interval, and a stop that lands within max(2 steps, ~0.4 s) of
the signal for fast and slow steps alike."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import pytest

from expgpu.procs import stop_signals
from expgpu.train import agreement
from expgpu.train.agreement import StopAgreement


@pytest.mark.parametrize("signals, agreed", [
    (["SIGUSR2", "SIGTERM"], "SIGTERM"),   # SLURM ending the job decides over expgpu's own requeue request
    (["SIGTERM", "SIGUSR2"], "SIGTERM"),
    (["SIGINT", "SIGUSR2"], "SIGUSR2"),
    (["SIGINT"], "SIGINT"),
])
def test_one_rank_stops_after_the_step_it_was_asked_in_on_the_strongest_signal(signals, agreed):
    signals_ = stop_signals.StopSignals()   # not installed: its handler is called as the signal would call it
    stopper = StopAgreement(signals_)
    assert stopper.begin(0, 100) is False and stopper.should_stop(1) is False
    for name in signals:
        signals_._on_signal(signal.Signals[name], None)
    assert stopper.should_stop(2) is True and stopper.agreed == agreed
    assert signals_.exit_code == 128 + signal.Signals[agreed]


def test_a_second_ctrl_c_aborts_unless_it_is_the_same_press_arriving_twice(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stop_signals.time, "monotonic", lambda: now[0])
    stopper = stop_signals.StopSignals()
    stopper._on_signal(signal.SIGINT, None)
    now[0] += stop_signals.SAME_CTRL_C_S / 2      # the launcher passed it on, and the terminal sent it too
    stopper._on_signal(signal.SIGINT, None)
    assert stopper.received == "SIGINT"
    now[0] += stop_signals.SAME_CTRL_C_S * 2      # a person pressing again: stop now, unsaved
    with pytest.raises(KeyboardInterrupt):
        stopper._on_signal(signal.SIGINT, None)


def test_a_stop_asked_for_at_a_step_is_a_sigterm_there():
    # checkpoint.verify stops its copy so, on every rank at once
    stopper = StopAgreement(stop_signals.StopSignals(), stop_at=5)
    assert [stopper.should_stop(s) for s in (3, 4, 5)] == [False, False, True]
    assert stopper.agreed == "SIGTERM"


def _loop(rank: int, store: str, out: str, pace: list, signal_at: int, max_steps: int) -> None:
    """`max_steps` steps paced by `pace` ([[first step, seconds], ...]); rank 1 sends itself SIGTERM
    during step `signal_at`. Records every poll (where the next one was scheduled) and the stop."""
    import datetime

    import torch.distributed as dist

    from expgpu.distributed import group as expgpu_dist

    stopper = StopAgreement(stop_signals.StopSignals().install(), world_size=2)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    polls, stopped_at = [], None
    try:
        stopper.begin(0, max_steps - 1)
        for step in range(1, max_steps):
            time.sleep(next(s for first, s in reversed(pace) if step >= first))
            if rank == 1 and step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            before = stopper._next
            if stopper.should_stop(step):
                stopped_at = step
                break
            if stopper._next != before:
                polls.append([step, stopper._interval])
        stopper.settle()
        dist.barrier()
    finally:
        dist.destroy_process_group()
        expgpu_dist._let_gloo_threads_finish()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"polls": polls, "stopped_at": stopped_at, "agreed": stopper.agreed}, f)


def _run(tmp_path, pace, signal_at: int, max_steps: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = str(tmp_path / "polls")
    procs = [ctx.Process(target=_loop, args=(r, str(tmp_path / "store"), out, pace, signal_at, max_steps))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    # The same poll steps and intervals on both ranks: a skipped collective would hang the other.
    assert ranks[0] == ranks[1]
    assert ranks[0]["agreed"] == "SIGTERM"
    return ranks[0]


SLOW_STEPS, SLOW_S, FAST_S = 60, 0.010, 0.001   # 10 ms steps, then 1 ms steps
SIGNAL_AT, MAX_STEPS = 1500, 6000


@pytest.mark.slow
def test_the_ranks_poll_at_the_same_steps_every_0_2_s_and_stop_together(tmp_path):
    ran = _run(tmp_path, [[1, SLOW_S], [SLOW_STEPS, FAST_S]], SIGNAL_AT, MAX_STEPS)
    polls, stopped_at = ran["polls"], ran["stopped_at"]
    # Before any step is timed: after the first step.
    assert polls[0][0] == agreement.FIRST_INTERVAL == 1
    # 10 ms steps: about 0.2 s / 10 ms = 20 steps (sleep overshoots; a loaded CI machine more).
    slow = [i for s, i in polls if 2 < s < SLOW_STEPS]
    assert slow and all(5 <= i <= 20 for i in slow), polls
    # 1 ms steps: far more steps per poll (a loaded machine sleeps longer), never past 0.2 s of them.
    fast = [i for s, i in polls if 1000 < s <= SIGNAL_AT]
    assert fast and all(25 <= i <= 200 for i in fast), polls
    # The signal is acted on within two intervals of the moment it landed.
    assert SIGNAL_AT < stopped_at <= SIGNAL_AT + 2 * max(fast) + 1, (stopped_at, polls[-3:])


@pytest.mark.slow
@pytest.mark.parametrize("pace,signal_at,max_steps,stop_by", [
    ([[1, 0.3]], 2, 12, 3),                 # slow steps (0.3 s > the 0.2 s poll period): every step polls
    ([[1, 1.0], [2, FAST_S]], 1, 4000, 2),  # a first step of unknown length, then fast ones
    ([[1, FAST_S]], 2, 12, 11),             # a run shorter than one poll interval: its last poll reads
], ids=["slow-steps", "long-first-step", "run-shorter-than-an-interval"])
def test_a_stop_lands_from_the_first_step_whatever_the_step_time(tmp_path, pace, signal_at, max_steps, stop_by):
    ran = _run(tmp_path, pace, signal_at, max_steps)
    assert ran["stopped_at"] is not None, "the signal was ignored: the run trained to its end"
    assert signal_at <= ran["stopped_at"] <= stop_by, ran
