"""The stop poll on a real 2-rank gloo group: adaptive interval, same steps on every rank."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

from expgpu import stopping

SLOW_STEPS, SLOW_S, FAST_S = 60, 0.010, 0.001   # 10 ms steps, then 1 ms steps
SIGNAL_AT, MAX_STEPS = 1500, 6000


def _loop(rank: int, store: str, out: str) -> None:
    """Steps of a paced loop; rank 1 sends itself SIGTERM at SIGNAL_AT. Records every poll."""
    import datetime

    import torch.distributed as dist

    from expgpu import dist as expgpu_dist

    stopper = stopping.Stopper().install()
    stopper.world_size = 2
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    polls, stopped_at = [], None
    try:
        stopper.should_stop(0, force=True)
        for step in range(1, MAX_STEPS):
            time.sleep(SLOW_S if step < SLOW_STEPS else FAST_S)
            if rank == 1 and step == SIGNAL_AT:
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


def test_the_ranks_poll_at_the_same_steps_every_0_2_s_and_stop_together(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = str(tmp_path / "polls")
    procs = [ctx.Process(target=_loop, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
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
    polls, stopped_at = ranks[0]["polls"], ranks[0]["stopped_at"]
    assert ranks[0]["agreed"] == "SIGTERM"
    # Before any step is timed: every FIRST_INTERVAL steps.
    assert polls[0] == [stopping.FIRST_INTERVAL, stopping.FIRST_INTERVAL]
    # 10 ms steps: about 0.2 s / 10 ms = 20 steps (sleep overshoots; a loaded CI machine more).
    slow = [i for s, i in polls if 2 * stopping.FIRST_INTERVAL < s < SLOW_STEPS]
    assert slow and all(5 <= i <= 20 for i in slow), polls
    # 1 ms steps: far more steps per poll (a loaded machine sleeps longer), never past 0.2 s of them.
    fast = [i for s, i in polls if 1000 < s <= SIGNAL_AT]
    assert fast and all(25 <= i <= 200 for i in fast), polls
    # The signal is acted on within two intervals of the moment it landed.
    assert SIGNAL_AT < stopped_at <= SIGNAL_AT + 2 * max(fast) + 1, (stopped_at, polls[-3:])
