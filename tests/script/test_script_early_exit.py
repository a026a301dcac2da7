"""A script task whose one rank exits 0 early (tests/scripts/ddp_early_exit.py: rank 1 leaves at step 10) is named
as the cause under every launcher, not the rank whose next collective lost it: expgpu's spawn
(test_script_run.py), torchrun and srun, where each rank is an expgpu process of its own and only the ranks'
records of their scripts' ends (expgpu.script.result) tell it. On a GPU node, where NCCL's watchdog aborts the
waiting rank after its collective's timeout with pages of C++ frames, the words it said before them are kept
(tests/scripts/nccl_timeout.py plays that rank). The rules themselves on made-up records."""

from __future__ import annotations

import sys

import pytest
from slurm_cluster import slurm_cluster  # noqa: F401

from conftest import REPO, expgpu
from expgpu import results
from expgpu.errors import collective_error
from expgpu.script import process
from expgpu.script.result import ended_early_of, failure, read_json

CONF = ["--config-dir", str(REPO / "tests" / "conf")]
ENDED = ("its process ended (code 0) while rank 0 still trained: its task ended on that rank alone (an early exit "
         "decided there: sys.exit(0) in a script, os._exit(0)), and rank 0's next collective ")
NAMED = "rank 1 failed: " + ENDED   # as the launch's last line and the job's failure record say it
ECHO = "RuntimeError: [/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6345"
TIMEOUT = "RuntimeError: [/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"
NCCL = ("[rank0]:[E1129 21:40:00.000000001 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600021 milliseconds before "
        "timing out.")
FRAMES = ["terminate called after throwing an instance of 'c10::DistBackendError'",
          *(f"frame #{i}: <unknown function> + 0x{i}0 (0x7f0{i} in /usr/lib/libtorch_cuda.so)" for i in range(9))]


def rec(rank: int, ended: float, code: int = 1, last: str = ECHO, stopped_by: str | None = None) -> dict:
    tail = ["Traceback (most recent call last):", f"[rank{rank}]: {last}"] if code else ["epoch 0: loss 1.0"]
    return {"rank": rank, "ended": ended, "exit_code": code, "signal": None, "stopped_by": stopped_by,
            "hung": False, "stderr_tail": tail}


def test_the_rank_whose_script_exited_0_first_is_the_cause_of_a_lost_peer_or_a_timeout(tmp_path):
    waiting = rec(0, 20.0)
    records = [waiting, rec(1, 12.0, code=0), rec(2, 15.0, code=0)]
    early = ended_early_of(waiting, records)
    assert (early.rank, early.message) == (1, ENDED + "lost it")
    line = failure(waiting, tmp_path, records=records)
    where = tmp_path / "logs" / "rank1.script.log"
    assert (line.rank, line.message) == (1, f"{ENDED}lost it (all its output: {where})")
    # the waiting rank's collective timed out instead (NCCL's way; gloo's words here): no rank ran on past it, so
    # not held_up's case
    waiting = rec(0, 620.0, last=TIMEOUT)
    assert ended_early_of(waiting, [waiting, rec(1, 12.0, code=0)]).message == ENDED + "timed out waiting for it"


def test_no_early_exit_without_a_rank_that_ended_0_before_a_collective_lost_it(tmp_path):
    waiting = rec(0, 20.0)
    # ended later, or stopped by a signal (it saved and left: a stop, which result.json says), or failed itself
    for other in (rec(1, 21.0, code=0), rec(1, 12.0, code=0, stopped_by="SIGTERM"), rec(1, 12.0, code=3)):
        assert ended_early_of(waiting, [waiting, other]) is None
    assert ended_early_of(waiting, [waiting, None]) is None   # its record never came
    # an error of its own, whoever left before: one of its own connections (rank 0's upload after the others ended)
    # lost, in a collective's words but not a collective's
    for last in ("ValueError: bad batch", "ConnectionResetError: [Errno 104] Connection reset by peer",
                 "BrokenPipeError: [Errno 32] Broken pipe"):
        own = rec(0, 20.0, last=last)
        assert ended_early_of(own, [own, rec(1, 12.0, code=0)]) is None
    own = rec(0, 20.0, last="ValueError: bad batch")
    assert failure(own, tmp_path, records=[own, rec(1, 12.0, code=0)]).message.startswith(
        "its script exited with code 1; the last lines of its stderr: Traceback")


def test_torch_distributeds_words_for_a_collective_that_lost_its_peer_or_timed_out_not_a_scripts_own():
    for line in (ECHO, TIMEOUT, NCCL, "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes",
                 "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited "
                 "or there was a network error, NCCL version 2.21.5"):
        assert collective_error(line), line
    for line in ("ConnectionResetError: [Errno 104] Connection reset by peer",
                 "BrokenPipeError: [Errno 32] Broken pipe",
                 "TimeoutError: timed out waiting for the download", "RuntimeError: NCCL is not available",
                 FRAMES[0], FRAMES[-1]):
        assert not collective_error(line), line


def test_what_nccl_said_before_its_abort_is_the_error_of_a_rank_whose_frames_fill_the_tail(tmp_path):
    waiting = {**rec(0, 620.0), "exit_code": 134, "signal": "SIGABRT", "stderr_tail": FRAMES, "collective_error": NCCL}
    assert ended_early_of(waiting, [waiting, rec(1, 12.0, code=0)]).message == ENDED + "timed out waiting for it"
    alone = failure(waiting, tmp_path, records=[waiting, rec(1, 620.5, code=1)]).message
    assert alone.startswith("its script was killed by SIGABRT; before it: [Rank 0] Watchdog caught collective "
                            "operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, Timeout(ms)=600000)"), alone
    ran_on = failure(waiting, tmp_path, records=[waiting, rec(1, 700.0, code=1)]).message
    assert ran_on.startswith("its script's collective timed out ([Rank 0] Watchdog caught collective operation timeout"
                             ) and "while rank 1's script ran on for 80 s" in ran_on, ran_on
    # not an abort: the last line is the error, whatever collective words came before it
    own = {**rec(0, 20.0, last="ValueError: bad batch"), "collective_error": NCCL}
    assert ended_early_of(own, [own, rec(1, 12.0, code=0)]) is None


def test_a_scripts_first_collective_error_is_kept_past_the_tail(tmp_path):
    frames = "".join(f"print('frame #{i}: <unknown function>', file=sys.stderr); " for i in range(40))
    code = f"import os, sys; print('epoch 1', file=sys.stderr); print({NCCL!r}, file=sys.stderr); {frames}os.abort()"
    outcome = process.run_script([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, tmp_path,
                                 tmp_path / "script.log", type("NoStop", (), {"received": None})(), grace_s=5)
    assert outcome.returncode == -6 and outcome.collective == NCCL
    assert NCCL not in outcome.tail and outcome.tail[-1] == "frame #39: <unknown function>"


def test_a_rank_that_reported_a_peers_failure_hands_its_supervisor_that_peers_failure(tmp_path):
    # rank 0 of a script task raised rank 1's failure (expgpu.launch.failures.record): spawn reads it as rank 1's
    results.write_failure(tmp_path, 0, "rank 1 failed: its process ended (code 0)", of=1)
    assert results.read_failure(tmp_path, 0, 1) == results.Failure(1, "its process ended (code 0)", False, 1)
    results.write_failure(tmp_path, 2, "ValueError: its own")
    assert results.read_failure(tmp_path, 2, 1) == results.Failure(2, "ValueError: its own", False, 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "expgpu"]
    run = expgpu([*CONF, "task=script_early_exit"], tmp_path / "run", cmd=cmd)
    assert run.returncode == 1, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if line.startswith("expgpu: ")]
    assert said and said[-1].startswith(f"expgpu: {NAMED}lost it (all its output: "), said
    assert results.read_job_failure(run.run_dir)["message"].startswith(NAMED)   # the report's failure line


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_whose_nccl_collective_timed_out_names_the_rank_that_left_early(tmp_path):
    run = expgpu([*CONF, "task=script_nccl_timeout", "launch.nproc_per_node=2"], tmp_path / "run")
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"expgpu: {NAMED}timed out waiting for it (all its output: "), last
    records = [read_json(run.run_dir / ".expgpu" / f"script-rank{r}.json") for r in (0, 1)]
    assert records[0]["signal"] == "SIGABRT"
    assert "Watchdog caught collective operation timeout" in records[0]["collective_error"]
    assert records[1]["exit_code"] == 0 and records[1]["collective_error"] is None


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_under_srun(slurm_cluster, tmp_path):  # noqa: F811
    job = slurm_cluster.sbatch(["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
                                str(REPO / "scripts" / "expgpu.sbatch"), *CONF, "task=script_early_exit",
                                f"task.script={REPO / 'tests' / 'scripts' / 'ddp_early_exit.py'}"], cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=200) == "FAILED"
    log = (tmp_path / f"slurm-{job}.out").read_text()
    said = [line for line in log.splitlines() if line.startswith("expgpu: ")]
    assert said and said[-1].startswith(f"expgpu: {NAMED}lost it"), log[-3000:]
