"""Following a slurm_pool sweep's SLURM job from the login node: its state while it waits in the queue, its
output (the pool's board) while it runs, and at its end the sweep's exit code, which the job writes to
its exit file as its last act (a job that ended without one was cancelled, cut by its time limit or
lost its node)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

POLL_S = 1.0
SLURM_CALL_S = 15.0


def follow(record: Mapping[str, Any], out=sys.stdout) -> int:
    """The job's state while queued, its output while it runs, until it ends: the sweep's exit code. Ctrl-C
    detaches (0), saying how to follow again."""
    job, output, exit_file = record["job_id"], Path(record["output"]), Path(record["exit"])
    offset, said = 0, None
    try:
        while True:
            state = state_of(job)
            if state is not None and state != said and not state.startswith("RUNNING"):
                again = said is not None and said.startswith(("RUNNING", "COMPLETING")) \
                    and state.startswith(("PENDING", "REQUEUED"))
                print(f"slurm_pool: job {job} " + ("requeued: the sweep goes on in the same sweep dir when it runs "
                                                   "again" if again else state.lower()), file=out, flush=True)
            said = state or said
            offset = _tail(output, offset, out)
            if state is None:   # it left the queue: its last output, then how it ended
                _tail(output, offset, out)
                return _ended(job, exit_file, output)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        print(f"\nslurm_pool: detached; job {job} runs on. Follow it again: python -m expgpu.slurm.sweep_job "
              f"{record['sweep_dir']} (or tail -f {output}); stop it: scancel {job}", file=out, flush=True)
        return 0


def state_of(job: str) -> str | None:
    """squeue's state of the job (and why it waits), None once it has left the queue."""
    try:
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True,
                              timeout=SLURM_CALL_S)
    except subprocess.TimeoutExpired:
        return "UNKNOWN (squeue did not answer)"
    text = done.stdout.strip()
    if done.returncode != 0 or not text:
        return None
    state, _, reason = text.partition(" ")
    return f"{state} ({reason})" if state == "PENDING" and reason not in ("", "None") else state


def _tail(path: Path, offset: int, out) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    whole = data[:data.rfind(b"\n") + 1]
    if whole:
        out.write(whole.decode(errors="replace"))
        out.flush()
    return offset + len(whole)


def _ended(job: str, exit_file: Path, output: Path) -> int:
    for _ in range(10):   # the file system may show the job's last write a moment late
        try:
            return int(exit_file.read_text().strip())
        except (OSError, ValueError):
            time.sleep(0.5)
    print(f"expgpu: slurm_pool: job {job} ended without its sweep's exit code (cancelled, its time limit, a node "
          f"lost?); its output: {output}", file=sys.stderr, flush=True)
    return 1
