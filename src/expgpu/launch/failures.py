"""A rank's failure record (RUN_DIR/.expgpu/rank<N>.failure.json), and whose failure a rank's own error echoes.

The cause of a launch's end records its error before its process group goes down, so the earliest record is
the cause and later ones its echoes (a collective torn down: "connection closed by peer"). A rank killed
outright writes none: its supervisor (expgpu.launch.spawn) writes one for it, marked killed, which counts as
the earliest. A rank that finds its error an echo says one line naming the cause instead of a traceback of its
own (expgpu.launch.worker.main); the supervisor's last line names the cause too.
"""

from __future__ import annotations

import time
from pathlib import Path

from expgpu import results, rundir
from expgpu.errors import UserError, WorkerFailed, first_line, lost_peer, no_room, no_room_line, short, timed_out
from expgpu.results import write_failure

# How long a rank whose collective lost its peer waits for the supervisor's record of a peer killed outright
# (it polls every 0.05 s): past it, the rank's own error is shown (a peer on another node may never be known).
CAUSE_WAIT_S = 1.0


def failed_before(run_dir: Path, rank: int) -> list[int]:
    """The other ranks of this launch that recorded a failure before this one did (or before now, where this one
    has not yet): spawn removed any older records."""
    mine = results.failure_time(run_dir, rank)
    since = time.time() if mine is None else mine
    return [r for r in rundir.failure_ranks(run_dir)
            if r != rank and (results.failure_time(run_dir, r) or since) < since]


def lost_to(run_dir: Path, rank: int, before: list[int], wait_s: float = CAUSE_WAIT_S) -> list[int]:
    """Whom a rank whose collective lost its peer (expgpu.errors.lost_peer) lost it to: a rank its supervisor saw
    killed outright (it wrote no record: its supervisor writes one within a poll, so this waits up to wait_s
    for it), else a rank that failed before this one on an error of its own, else `before` (other ranks that
    lost a peer first: echoes too, named when nothing better turns up)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = {r: results.failure_record(run_dir, r) for r in rundir.failure_ranks(run_dir) if r != rank}
        killed = [r for r, info in records.items() if info.get("killed")]
        own = [r for r in before if not records.get(r, {}).get("lost_peer")]
        if killed or own or time.monotonic() >= deadline:
            return killed or own or before
        time.sleep(0.02)


def echo_of(run_dir: Path, rank: int, e: BaseException, wait_s: float = CAUSE_WAIT_S) -> str | None:
    """What a rank of srun's or torchrun's says instead of its traceback when its collective lost a peer
    (lost_peer): the rank that recorded an error of its own (RUN_DIR/.expgpu/failure.json, written before that
    rank's process group went down; this waits up to wait_s for it), else that a peer was killed outright
    (or ended early, os._exit(0)), which nobody records there. None for an error of its own."""
    if not lost_peer(e):
        return None
    deadline = time.monotonic() + wait_s
    while True:
        job = results.read_job_failure(run_dir) or {}
        if job.get("rank") not in (None, rank) and not job.get("lost_peer"):
            return f"rank {rank}: stopping: rank {job['rank']} failed: {job['message']}"
        if time.monotonic() >= deadline:
            return (f"rank {rank}: stopping: its process group lost a peer ({short(first_line(e))}), and no rank "
                    "recorded an error of its own: a rank was killed outright (kill -9, the OOM killer, its node "
                    "lost); the launcher's lines name it (srun: 'task N: Killed'); where they name none, a rank "
                    "ended early with code 0 (os._exit(0) decided on that rank alone)")
        time.sleep(0.05)


def record(run_dir: Path, rank: int, e: BaseException, step: int | None = None) -> None:
    """This rank's failure, for the supervisor, once: the first record is the time it failed; `step`: the
    steps its run had done (expgpu.launch.restarts compares them)."""
    if rundir.failure_file(run_dir, rank).exists():
        return
    try:
        if isinstance(e, UserError):
            write_failure(run_dir, rank, str(e), user_error=True)
        elif isinstance(e, WorkerFailed):   # rank 0 of a script task also reports a peer's failure: says whose
            own = e.failure.rank == rank   # its script's own end: an echo when its stderr says a peer went away
            write_failure(run_dir, rank, e.failure.message if own else str(e), lost_peer=own and lost_peer(e),
                          of=None if own else e.failure.rank)
        elif isinstance(e, KeyboardInterrupt):
            write_failure(run_dir, rank, "interrupted (second Ctrl-C)")
        elif no_room(e):
            write_failure(run_dir, rank, no_room_line(e), step=step)
        elif timed_out(e) and getattr(e, "__notes__", None):   # whom it waited for (expgpu.launch.worker), first
            write_failure(run_dir, rank, e.__notes__[-1], step=step)
        else:
            write_failure(run_dir, rank, f"{type(e).__name__}: {e}", step=step, lost_peer=lost_peer(e))
    except OSError:   # a full disk: the record is lost, not the error it records (raised on by the caller)
        pass
