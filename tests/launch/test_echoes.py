"""Whom a rank whose collective lost its peer names (fast tier, on written failure records): a rank its
supervisor saw killed outright, else a rank that failed first on an error of its own, else the ranks that
lost a peer before it. End to end (a rank killed by SIGKILL, one that raises): tests/e2e/test_cli.py
-k crashing_rank."""

from __future__ import annotations

import threading
import time

from expgpu import results
from expgpu.errors import lost_peer
from expgpu.launch.failures import echo_of, failed_before, lost_to

GLOO = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35526")


def test_gloo_and_nccl_say_a_peer_is_gone_in_words_lost_peer_knows():
    assert lost_peer(GLOO)
    assert lost_peer(RuntimeError("NCCL communicator was aborted on rank 1"))
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)"))


def test_a_peer_killed_outright_is_named_over_the_echoes_that_recorded_before_it(tmp_path):
    results.write_failure(tmp_path, 2, f"RuntimeError: {GLOO}", lost_peer=True)   # an echo, first
    time.sleep(0.01)
    results.write_failure(tmp_path, 0, f"RuntimeError: {GLOO}", lost_peer=True)
    before = failed_before(tmp_path, 0)
    assert before == [2]

    def supervisor():   # sees rank 1 dead at its next poll, and records it
        time.sleep(0.1)
        results.write_failure(tmp_path, 1, "killed by SIGKILL", killed=True)

    threading.Thread(target=supervisor).start()
    # a wait far longer than the supervisor's poll: a loaded machine may run its thread late
    assert lost_to(tmp_path, 0, before, wait_s=30) == [1]
    # its record is the earliest, whenever it was written: the supervisor ranks it first too
    assert results.failure_time(tmp_path, 1) == float("-inf") < results.failure_time(tmp_path, 2)


def test_a_peer_that_failed_first_on_its_own_error_is_named_at_once(tmp_path):
    results.write_failure(tmp_path, 3, "RuntimeError: injected crash")
    results.write_failure(tmp_path, 2, f"RuntimeError: {GLOO}", lost_peer=True)
    time.sleep(0.01)
    results.write_failure(tmp_path, 0, f"RuntimeError: {GLOO}", lost_peer=True)
    t0 = time.monotonic()
    assert lost_to(tmp_path, 0, failed_before(tmp_path, 0), wait_s=30) == [3]
    assert time.monotonic() - t0 < 10   # at once, not after the wait for a supervisor's record


def test_with_no_better_cause_in_time_the_earlier_echoes_are_named(tmp_path):
    results.write_failure(tmp_path, 2, f"RuntimeError: {GLOO}", lost_peer=True)
    time.sleep(0.01)
    results.write_failure(tmp_path, 0, f"RuntimeError: {GLOO}", lost_peer=True)
    assert lost_to(tmp_path, 0, failed_before(tmp_path, 0), wait_s=0.1) == [2]
    assert lost_to(tmp_path, 2, failed_before(tmp_path, 2), wait_s=0.1) == []   # the first: its traceback


# srun's and torchrun's ranks have no supervisor of expgpu's: one record for the job (RUN_DIR/.expgpu/failure.json),
# the first rank's to fail. End to end: tests/slurm/test_slurm_bad_node.py -k killed_outright.

def test_an_srun_rank_that_lost_its_peer_names_the_rank_that_recorded_its_own_error(tmp_path):
    results.write_job_failure(tmp_path, "RuntimeError: injected crash", rank=1, step=5)
    assert echo_of(tmp_path, 0, GLOO) == "rank 0: stopping: rank 1 failed: RuntimeError: injected crash"
    assert echo_of(tmp_path, 0, RuntimeError("injected crash")) is None   # an error of its own: its traceback


def test_when_only_echoes_recorded_an_srun_rank_says_a_peer_was_killed_outright(tmp_path):
    # the first echo's record (rank 2's), marked as one: no rank names it, itself included
    results.write_job_failure(tmp_path, f"RuntimeError: {GLOO}", rank=2, step=5, lost_peer=True)
    for rank in (0, 2):
        line = echo_of(tmp_path, rank, GLOO, wait_s=0.1)
        assert line == (f"rank {rank}: stopping: its process group lost a peer (Connection closed by peer "
                        "[127.0.0.1]:35526), and no rank recorded an error of its own: a rank was killed outright "
                        "(kill -9, the OOM killer, its node lost); the launcher's lines name it (srun: 'task N: "
                        "Killed'); where they name none, a rank ended early with code 0 (os._exit(0) decided on "
                        "that rank alone)")


def test_an_srun_rank_waits_a_moment_for_the_cause_to_record(tmp_path):
    def cause():
        time.sleep(0.1)
        results.write_job_failure(tmp_path, "RuntimeError: injected crash", rank=3, step=5)

    threading.Thread(target=cause).start()
    assert echo_of(tmp_path, 0, GLOO) == "rank 0: stopping: rank 3 failed: RuntimeError: injected crash"
