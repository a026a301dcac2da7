"""hydra.launcher.jobs_per_gpu: several of a sweep's jobs on each GPU (expgpu.pool.sharing). Simulated GPUs and
real processes (tests/helpers/pool_sweep.py's sleeping task); the leases with real flocks: a share beside
other shares, and never beside a lease of the whole card (another sweep's without sharing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pool_sweep import Sweep, gpus_of, most_at_once, runs, simulate

from expgpu.gpus import inventory
from expgpu.pool import leases, sharing
from expgpu.pool.scheduler import Scheduler

CARDS = [{"name": "A100", "memory_mb": 40960}] * 2


def test_a_share_is_leased_beside_other_shares_and_never_beside_the_whole_card(tmp_path):
    gpus = inventory(CARDS, env={})
    first, second = [s for s in sharing.shares(gpus, 2) if s.index == 0]
    a = leases.try_acquire(tmp_path, first)
    b = leases.try_acquire(tmp_path, second)
    assert a is not None and b is not None                      # two shares of GPU 0 at once
    assert leases.try_acquire(tmp_path, first) is None          # a share once
    assert leases.try_acquire(tmp_path, gpus[0]) is None        # a sweep without sharing waits for the card
    assert leases.try_acquire(tmp_path, gpus[1]) is not None    # ... the other card is free
    a.release()
    assert leases.try_acquire(tmp_path, gpus[0]) is None        # one sharer left on it
    b.handed_over()   # the job's copy: closing ours ends the lease as the job's exit would
    whole = leases.try_acquire(tmp_path, gpus[0])
    assert whole is not None and leases.try_acquire(tmp_path, first) is None   # and the other way round
    whole.note(pid=4711, sweep="other")
    assert leases.noted(tmp_path, first)["pid"] == 4711         # who holds it, said for a share too


def test_sweeps_sharing_a_gpu_with_different_jobs_per_gpu_keep_to_the_smallest(tmp_path):
    gpu = inventory(CARDS, env={})[0]
    by_two = [s for s in sharing.shares([gpu], 2)]
    by_four = [s for s in sharing.shares([gpu], 4)]
    a = leases.try_acquire(tmp_path, by_four[0])
    b = leases.try_acquire(tmp_path, by_four[1])
    assert a and b                                                # 2 jobs of a sweep by 4 on the card
    assert leases.try_acquire(tmp_path, by_two[0]) is None        # its share 1 is held
    assert leases.try_acquire(tmp_path, by_two[1]) is None        # free, but a job by 2 would be the card's 3rd
    b.handed_over()
    c = leases.try_acquire(tmp_path, by_two[1])
    assert c is not None                                          # now the card's 2nd: room for it
    assert leases.try_acquire(tmp_path, by_four[2]) is None       # and its holder's N=2 keeps the sweep by 4 out
    c.release()
    d = leases.try_acquire(tmp_path, by_four[2])
    e = leases.try_acquire(tmp_path, by_four[3])
    assert d and e and leases.try_acquire(tmp_path, by_four[1])   # by 4 alone: 4 on the card
    for lease in (a, d, e):
        lease.release()


def test_a_share_waits_for_the_cards_admission_lock_a_while_then_asks_again_later(tmp_path, monkeypatch):
    import fcntl
    import os
    import time

    gpu = inventory(CARDS, env={})[0]
    share = sharing.shares([gpu], 2)[0]
    monkeypatch.setattr(leases, "ADMIT_TIMEOUT_S", 0.2)
    counting = os.open(leases.lock_path(tmp_path, gpu, ".admit"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(counting, fcntl.LOCK_EX)   # a sharer stopped in the middle of its count
    t0 = time.monotonic()
    assert leases.try_acquire(tmp_path, share) is None and time.monotonic() - t0 < 2
    whole = leases.try_acquire(tmp_path, gpu)
    assert whole is not None   # nothing was held: the card was free all along
    whole.release()
    os.close(counting)   # the count is over
    lease = leases.try_acquire(tmp_path, share)
    assert lease is not None
    lease.release()


def test_shares_spread_over_the_gpus_first_and_a_job_takes_different_gpus():
    gpus = inventory(CARDS, env={})
    keys = [sharing.key(s) for s in sharing.shares(gpus, 2)]
    assert keys == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert sharing.shares(gpus, 1) == gpus                       # no sharing: the GPUs themselves
    picked = Scheduler(patience=1).pick([("a", 1), ("b", 2), ("c", 1)], keys, [], 9, sharing.distinct)
    assert picked == [("a", ((0, 0),), None), ("b", ((1, 0), (0, 1)), None), ("c", ((1, 1),), None)]
    assert sharing.distinct([(0, 1), (0, 2)], "d", 2) is None     # two shares of one GPU are not two GPUs
    assert sharing.shown(sharing.shares(gpus, 4)[3:4]) == "GPU 1 (share 2 of 4)"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_jobs_on_each_gpu_at_once_spread_over_them_first(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=1.5", "task.model.tag=range(6)", simulate(2),
                      "hydra.launcher.jobs_per_gpu=2"])
    assert done.returncode == 0, done.stderr
    jobs = runs(sweep)
    assert len(jobs) == 6 and most_at_once(jobs) >= 3, jobs   # more at once than the 2 GPUs alone allow
    for job in jobs:   # never three on one GPU
        beside = [o for o in jobs if o["t0"] <= job["t0"] < o["t1"] and gpus_of(o) == gpus_of(job)]
        assert len(beside) <= 2, (job, beside)
    pool = sweep.pool()
    assert pool["jobs_per_gpu"] == 2 and pool["pool"] == [0, 1]
    rows = {j["num"]: j for j in pool["jobs"]}
    assert {(rows[n]["gpus"][0], rows[n]["shares"][0]) for n in (0, 1)} == {(0, 0), (1, 0)}   # spread first
    assert all(j["state"] == "finished" and j["cvd"] == str(rows[j["job"]]["gpus"][0]) for j in
               [{**r, "state": rows[r["job"]]["state"]} for r in jobs])
    assert "GPU 0,1 (simulated), 2 jobs on each" in done.stdout + done.stderr
    assert "(share 2 of 2)" in done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_jobs_per_gpu_on_a_pool_without_gpus_is_one_line(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.tag=0,1", "inventory.simulate=[]", "hydra.launcher.jobs_per_gpu=2"],
                     timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "expgpu: error: hydra.launcher.jobs_per_gpu=2 shares GPUs, and this pool has none (its jobs take CPU "
        "slots): drop it, or give more jobs at once with hydra.launcher.cpu_slots")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_on_a_real_gpu_its_jobs_train_on_it_at_once(tmp_path):
    sweep = Sweep(tmp_path, lease_dir=tmp_path / "gpu-leases")
    done = sweep.run(["task=a", "task.max_steps=1500", "task.seed=range(4)", "hydra.launcher.gpus=[0]",
                      "hydra.launcher.jobs_per_gpu=2"], timeout=280)
    assert done.returncode == 0, done.stderr
    jobs = sweep.pool()["jobs"]
    spans = []
    for j in jobs:
        result = json.loads((Path(j["dir"]) / "result.json").read_text())
        assert result["status"] == "finished" and result["plan"][0]["device"].startswith("cuda"), result
        assert j["gpus"] == [0] and result["plan"][0]["gpus"] == [0]
        spans.append({"t0": j["started"], "t1": j["ended"]})
    assert most_at_once(spans) == 2   # two on GPU 0 at once, never three
