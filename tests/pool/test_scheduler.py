"""The gpu_pool's scheduler and its thread budget alone (pure), and which jobs it primes."""

from __future__ import annotations

from expgpu.pool import Scheduler
from expgpu.pool.scheduler import at_once, thread_budget


def test_scheduler_fills_free_gpus_in_order_and_mixes_sizes():
    s = Scheduler(patience=4)
    starts = s.pick([("a", 2), ("b", 1), ("c", 2), ("d", 1)], [0, 1, 2, 3], [], room=10)
    assert starts == [("a", (0, 1), None), ("b", (2,), None), ("d", (3,), None)]  # c waits: 1 GPU left
    # c needs 2, only 1 free: later 1-GPU jobs pass it...
    assert s.pick([("c", 2), ("e", 1)], [1], [], room=10) == [("e", (1,), None)]
    # ...and c starts as soon as 2 are free.
    assert s.pick([("c", 2), ("f", 1)], [0, 3], [], room=10) == [("c", (0, 3), None)]


def test_scheduler_stops_passing_a_blocked_job_after_patience():
    s = Scheduler(patience=2)
    queue = [("big", 2)] + [(f"small{i}", 1) for i in range(6)]
    assert s.pick(queue, [0], [], 10) == [("small0", (0,), None)]
    assert s.pick(queue[:1] + queue[2:], [1], [], 10) == [("small1", (1,), None)]
    assert s.pick(queue[:1] + queue[3:], [0], [], 10) == []          # passed twice: GPUs are kept
    assert s.pick(queue[:1] + queue[3:], [0, 1], [], 10) == [("big", (0, 1), None)]


def test_scheduler_cpu_slots_and_room():
    s = Scheduler(patience=1)
    assert s.pick([("a", 0), ("b", 0), ("c", 0)], [], [0, 1], room=10) == [("a", (), 0), ("b", (), 1)]
    assert s.pick([("a", 1), ("b", 1), ("c", 1)], [0, 1, 2], [], room=2) == [("a", (0,), None), ("b", (1,), None)]


def test_only_hydras_and_expgpus_own_code_is_primed_on_real_gpus():
    from types import SimpleNamespace

    from hydra.experimental.callback import Callback

    from expgpu import app
    from expgpu.pool.spares import primable
    from expgpu.report.callback import SweepReport

    def users_main(cfg):
        return cfg

    ours = SimpleNamespace(callbacks=SimpleNamespace(callbacks=[SweepReport()]))
    assert primable(ours, app.run, own_code=False)         # expgpu's app: its task modules come after the hand-over
    assert not primable(ours, users_main, own_code=False)  # another app's function imports the user's modules
    assert primable(ours, users_main, own_code=True)       # CPU slots, simulated GPUs: no CUDA to get wrong

    class Theirs(Callback):
        def on_job_start(self, config, **kwargs):
            pass

    theirs = SimpleNamespace(callbacks=SimpleNamespace(callbacks=[SweepReport(), Theirs()]))
    assert not primable(theirs, app.run, own_code=True)    # its on_job_start would run before the hand-over


def test_thread_budget_shares_the_cores_among_the_jobs_that_run_at_once():
    assert at_once([0] * 6, n_gpus=0, cpu_slots=2, max_parallel=None) == 2
    assert thread_budget(2, [0] * 6, 0, 2, None) == 1           # 2 cores, 2 slots: 1 thread each
    assert thread_budget(16, [0] * 6, 0, 2, None) == 8
    assert thread_budget(16, [0], 0, 4, None) == 16              # one job alone gets every core
    assert thread_budget(16, [1] * 8, 4, 1, None) == 4           # 4 GPU jobs at once
    assert thread_budget(16, [2] * 8, 4, 1, None) == 8           # 2-GPU jobs: 2 at once
    assert thread_budget(16, [1] * 8, 4, 1, max_parallel=2) == 8
    assert thread_budget(2, [1] * 8, 8, 1, None) == 1            # never 0
