"""Stop, checkpoint, resume, on CPU with real processes: the resumed run ends exactly where
an uninterrupted one does (same parameter checksum, same losses at every logged step).

A run is interrupted by the signals a user or a scheduler sends: SIGTERM to the `python -m
expgpu` process (as `kill` or SLURM does), SIGINT to its whole process group (as a
terminal's Ctrl-C does), SIGUSR2 (SLURM's warning before a time limit); also a crashed
rank with periodic checkpoints. Then a bad checkpoint: corrupt, truncated, of another
task, on a world size that does not divide the global batch: one line naming the file, exit 2, the file untouched.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import Run, clean_env, expgpu, finish, start, wait_for_progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.xdist_group("test_resume")]

# Task a sized so that a signal sent at its first metrics row (step 5, handed to the OS at once)
# lands mid-training, not after the end: one rank reads a stop after every step (it stops at
# step 5-6 here), two ranks poll after every step until steps are timed, then every ~0.2 s
# (they stopped at steps 17-35 here, ~280 steps/s): 300 steps leave a margin of 8 or more.
STEPS = 300
ARGS = ["task=a", f"task.max_steps={STEPS}", "task.log_every=5", "backend.timeout_s=60"]
# Launches as most users start them, without a warm server (conftest.clean_env): one rank trains in
# its launcher, which takes the signals itself. (tests/launch/test_warm_server.py stops a forked one.)
ENV = clean_env(EXPGPU_WARM_SERVER="")


def _nproc(n: int) -> list[str]:
    return [f"launch.nproc_per_node={n}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs (1 and 2 ranks), computed once."""
    cache: dict[int, Run] = {}

    def get(nproc: int) -> Run:
        if nproc not in cache:
            run = expgpu(ARGS + _nproc(nproc), tmp_path_factory.mktemp(f"ref{nproc}") / "run", env=ENV)
            assert run.returncode == 0, run.stderr
            assert run.result["status"] == "finished" and run.result["resumed_from_step"] is None
            cache[nproc] = run
        return cache[nproc]

    return get


def _losses(run: Run) -> dict[int, float]:
    rows = run.metrics()
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"metrics.jsonl repeats or reorders steps: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def _interrupt(args: list[str], run_dir: Path, sig: signal.Signals, group: bool) -> Run:
    proc = start(args, run_dir, env=ENV)
    wait_for_progress(proc, run_dir)
    if group:
        os.killpg(proc.pid, sig)  # what a terminal does on Ctrl-C: every process of the job
    else:
        proc.send_signal(sig)     # `kill PID`, SLURM's signal to the step's process
    return finish(proc, run_dir)


def _assert_stopped(run: Run, sig: signal.Signals) -> int:
    assert run.returncode == 128 + sig, (run.returncode, run.stderr[-3000:])
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: stopped at step ") and f"by {sig.name}" in last, last
    assert f"hydra.run.dir={run.run_dir}" in last, last
    assert (run.run_dir / "checkpoint.pt").exists()
    res = run.result
    assert res["status"] == "stopped" and res["stop_signal"] == sig.name, res
    assert 0 < res["steps"] < STEPS, f"not stopped mid-training: {res['steps']}"
    return res["steps"]


def _assert_resumes_to_reference(args: list[str], run_dir: Path, stopped_at: int, ref: Run) -> None:
    resumed = expgpu(args, run_dir, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    res = resumed.result
    assert res["status"] == "finished" and res["steps"] == STEPS
    assert res["resumed_from_step"] == stopped_at
    assert res["param_checksum"] == ref.result["param_checksum"]
    assert len(set(res["rank_checksums"])) == 1
    # Data order resumed exactly: every logged loss after the resume is the uninterrupted run's
    # (and the rows before it are the interrupted run's, kept, not repeated).
    want, got = _losses(ref), _losses(resumed)
    after = {s: v for s, v in want.items() if s > stopped_at}
    assert after and {s: got.get(s) for s in after} == after
    assert got == want


@pytest.mark.parametrize("nproc,sig,group", [
    (1, signal.SIGTERM, False),
    (1, signal.SIGINT, True),
    (2, signal.SIGTERM, False),   # to the supervisor alone: it forwards to its workers
    (2, signal.SIGINT, True),     # Ctrl-C: supervisor and workers all get it
    (1, signal.SIGUSR2, False),   # SLURM's time-limit warning, outside SLURM: stop, no requeue
], ids=["1rank-SIGTERM", "1rank-ctrl-c", "2ranks-SIGTERM", "2ranks-ctrl-c", "1rank-SIGUSR2"])
def test_interrupted_run_resumes_to_the_uninterrupted_parameters(tmp_path, reference, nproc, sig, group):
    args = ARGS + _nproc(nproc)
    ref = reference(nproc)
    run_dir = tmp_path / "run"
    stopped = _interrupt(args, run_dir, sig, group)
    stopped_at = _assert_stopped(stopped, sig)
    if nproc > 1:
        assert stopped.result["rank_checksums"][0] == stopped.result["rank_checksums"][1]
    _assert_resumes_to_reference(args, run_dir, stopped_at, ref)


def _sig_caught(pid: int, sig: signal.Signals) -> bool:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in text.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask & (1 << (sig - 1)))


def test_sigterm_while_starting_up_is_kept(tmp_path, reference):
    """A signal that lands while Hydra composes and torch imports stops the run at its first
    step boundary, with a checkpoint, instead of killing it."""
    run_dir = tmp_path / "run"
    proc = start(ARGS, run_dir, env=ENV)
    deadline = time.monotonic() + 30
    while not _sig_caught(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert not (run_dir / "metrics.jsonl").exists(), "too late: training already started"
    proc.send_signal(signal.SIGTERM)
    run = finish(proc, run_dir)
    assert run.returncode == 143, run.stderr[-3000:]
    assert run.result["status"] == "stopped" and run.result["steps"] == 0
    assert (run_dir / "checkpoint.pt").exists()
    _assert_resumes_to_reference(ARGS, run_dir, 0, reference(1))


def test_crashed_rank_resumes_from_the_periodic_checkpoint(tmp_path, reference):
    # 2 ranks x 64 examples per batch: an epoch of task a is 32 steps, so the checkpoint at
    # step 64 sits exactly on an epoch boundary (position == batches per epoch). Steps paced to
    # ~50 ms (32 examples a rank) make the 36 steps past the checkpoint outlast metrics.jsonl's
    # once-a-second write-out, so rows past it are on disk before the crash however loaded the machine.
    args = ARGS + _nproc(2)
    run_dir = tmp_path / "run"
    crashed = expgpu(args + ["checkpoint.every_steps=64", "faults.crash_rank=1", "faults.crash_step=100",
                             "faults.device_ms_per_example=1.5"], run_dir, env=ENV)
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    assert "injected crash" in crashed.stderr.strip().splitlines()[-1]
    assert not (run_dir / "result.json").exists()
    logged = [r["step"] for r in crashed.metrics()]
    assert max(logged) > 64, logged  # steps after the checkpoint were logged, and will be redone
    _assert_resumes_to_reference(args, run_dir, 64, reference(2))


# -- checkpoints that must not be resumed ------------------------------------------------------

@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> bytes:
    run_dir = tmp_path_factory.mktemp("good") / "run"
    run = expgpu(["task=a", "task.max_steps=20"], run_dir, env=ENV)
    assert run.returncode == 0, run.stderr
    return (run_dir / "checkpoint.pt").read_bytes()


def _bad(good: bytes, kind: str) -> bytes:
    if kind == "corrupt":
        return os.urandom(len(good))
    if kind == "truncated":
        return good[: len(good) // 2]
    return good


@pytest.mark.parametrize("kind,args,says", [
    ("corrupt", ["task=a"], "is corrupt or truncated"),
    ("truncated", ["task=a"], "is corrupt or truncated"),
    ("other task", ["task=b"], "was written with task='a', this run has task='b'"),
    ("world size not dividing the global batch", ["task=a", "launch.nproc_per_node=3"],
     "= a global batch of 64, which 3 ranks cannot share equally"),
    ("other task settings", ["task=a", "task.batch_size=32"], "was written with other task settings"),
    ("a setting inside a section", ["task=a", "task.model.hidden=64"],   # the key in it, not the whole section
     "was written with other task settings (task.model.hidden=128, now 64); resume with the same settings"),
])
def test_bad_checkpoint_is_one_line_naming_the_file(tmp_path, good_checkpoint, kind, args, says):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = run_dir / "checkpoint.pt"
    ckpt.write_bytes(_bad(good_checkpoint, kind))
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    run = expgpu(args + ["task.max_steps=40"], run_dir, env=ENV, timeout=120)
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    errors = [line for line in run.stderr.splitlines() if line.startswith("expgpu: error:")]
    assert len(errors) == 1 and errors[0] == run.stderr.strip().splitlines()[-1], run.stderr[-3000:]
    assert f"checkpoint {ckpt} " in errors[0] and says in errors[0], errors[0]
    assert "Traceback" not in run.stderr
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before, "the checkpoint was changed"
    assert not (run_dir / "result.json").exists(), "it trained anyway"


def test_resume_false_starts_over_and_replaces_the_checkpoint(tmp_path, good_checkpoint):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(os.urandom(100))
    run = expgpu(["task=a", "task.max_steps=20", "checkpoint.resume=false"], run_dir, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["resumed_from_step"] is None
    assert (run_dir / "checkpoint.pt").read_bytes() == good_checkpoint  # same seed, same weights
