"""expgpu's own local launcher: N worker processes, fail-fast, no orphans.

Each worker runs expgpu.launch.worker on RUN_DIR: it learns its rank from EXPGPU_* variables and
isolates its GPU before CUDA starts. It is forked from a process that imported torch (rank_server:
this launch's own, expgpu.launch.warm, or one shared by launches, expgpu.launch.warm_server), or started
fresh (`python -m expgpu.launch.worker RUN_DIR`). The parent never imports torch and only
watches: when one worker fails, the others are stopped at once (SIGTERM, then SIGKILL after a
grace period) and the failure is reported with the rank and its error. Workers die with the
parent (PR_SET_PDEATHSIG; a warm server's kills them when the parent's connection closes), so a
killed parent leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from expgpu import envvars, procs
from expgpu.errors import EXIT_PEER_FAILED, UserError
from expgpu.launch.failures import CAUSE_WAIT_S
from expgpu.procs import oom, stop_signals
from expgpu.procs.handles import ProcHandle, RankStarter
from expgpu.results import Failure, ended_early, failure_record, failure_time, read_failure, write_failure
from expgpu.rundir import failure_file, failure_files

log = logging.getLogger("expgpu")

GRACE_S = 5.0  # a stopped worker gets this long to exit before SIGKILL


def _child_setup() -> None:
    procs.die_with_parent()
    # A stop signal that lands before the worker installs its handler would kill it
    # unsaved (SIGTERM's, SIGUSR2's default action): hold them until launch.worker.main does.
    stop_signals.block_in_child()


def _stop(workers: list[ProcHandle], sig: int = signal.SIGTERM, grace_s: float = GRACE_S) -> None:
    """Signal the workers still running, then SIGKILL those left after grace_s."""
    for p in workers:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for local_rank, p in enumerate(workers):
        try:
            code = p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            if sig != signal.SIGKILL:   # what it had not yet written (its loggers' run's end) is lost: say so
                log.warning("local rank %d did not end within %.0f s of %s: killed", local_rank, grace_s,
                            signal.Signals(sig).name)
            p.kill()
            p.wait()


def _threads_per_worker(nproc: int) -> dict[str, str]:
    """torch's intra-op threads per worker (OMP/MKL_NUM_THREADS), unless the user chose.

    Each worker would otherwise start one thread per core: N workers oversubscribe the
    cores N times over, and CPU training runs several times slower (torchrun sets 1).
    Here each worker gets its share of the cores this process may run on.
    """
    if procs.user_threads():
        return {}
    cores = procs.cores()
    threads = max(1, cores // nproc)
    log.info("OMP_NUM_THREADS=%d for each of %d workers (%d cores); set it to choose", threads, nproc, cores)
    return procs.threads_env(threads)


def run_node(nproc: int, run_dir: Path, env_extra: dict[str, str] | None = None,
        node_rank: int = 0, nnodes: int = 1, master_addr: str = "127.0.0.1",
        master_port: int = 0, grace_s: float = GRACE_S, server=None) -> Failure | None:
    """Start nproc workers and wait; None when all succeeded, else the first failure. When one fails,
    the others get SIGTERM and grace_s to exit. `server`: what forks them from a process that
    imported torch (rank_server's; the caller closes it), None: each starts fresh."""
    launch = uuid.uuid4().hex[:12]
    world = nproc * nnodes
    procs.atexit_grace_s()   # a bad EXPGPU_ATEXIT_GRACE_S: one line now, not at every rank's exit
    for stale in failure_files(run_dir):  # from a run this one resumes
        stale.unlink()
    stopper = stop_signals.current()
    early = stopper.received if stopper else None  # a signal while Hydra composed: pass it on
    threads = _threads_per_worker(nproc)
    workers: list = []
    for local_rank in range(nproc):
        env = dict(os.environ, **(env_extra or {}), **threads)
        env.update({
            envvars.RANK: str(node_rank * nproc + local_rank), envvars.LOCAL_RANK: str(local_rank),
            envvars.WORLD_SIZE: str(world), envvars.LOCAL_WORLD_SIZE: str(nproc),
            envvars.NODE_RANK: str(node_rank), envvars.MASTER_ADDR: master_addr,
            envvars.MASTER_PORT: str(master_port),  # 0: rank 0 binds one and publishes it
            envvars.LAUNCH_ID: launch,
        })
        if stopper is not None:  # workers stop on what this process stops on (StopSignals.install)
            env[stop_signals.ENV_SIGNALS] = ",".join(stopper.owned)
        # A session of its own, as torchrun's workers: a terminal's Ctrl-C reaches this supervisor
        # only, which passes it on once, as it does a signal sent to its pid alone (a scheduler,
        # `kill -INT`). Sent to both, a Ctrl-C would arrive twice and read as "abort unsaved".
        workers.append(_start(server, env, run_dir))
    oom_counts = [oom.OomCount(p.pid) for p in workers]   # a rank killed by SIGKILL: was it the OOM killer?

    def forward(signum, frame):
        for p in workers:   # send_signal skips one that has exited (and reads no pipe or socket)
            p.send_signal(signum)

    passed_on = [s for s in stop_signals.STOP_SIGNALS if stopper is None or s.name in stopper.owned]
    old = {s: signal.signal(s, forward) for s in passed_on}
    # Workers hold stop signals until their handler is in (block_in_child), so none is lost.
    late = stopper.received if stopper else None  # while the workers were being started
    for name in {early, late} - {None}:
        for p in workers:
            p.send_signal(signal.Signals[name])
    ended: dict[int, float] = {}   # rank -> when this loop saw it exit with code 0
    try:
        while True:
            codes = [p.poll() for p in workers]
            ended.update({r: time.time() for r, c in enumerate(codes) if c == 0 and r not in ended})
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                _record_killed(run_dir, bad, oom_counts)
                # The earliest failure is the cause; the others' errors are its echo
                # ("connection closed by peer"). A rank killed outright wrote nothing:
                # it went first. The cause may still be exiting (printing its traceback,
                # tearing its group down) when its echo has already ended: it counts too.
                # A rank its watchdog ended because a peer failed (EXIT_PEER_FAILED) is an echo: last.
                bad = _failed(run_dir, workers, bad)
                rank, code = min(bad, key=lambda rc: (rc[1] == EXIT_PEER_FAILED, _echo(run_dir, rc[0]),
                                                      _recorded(run_dir, rc[0])))
                _stop(workers, grace_s=grace_s)
                cause = read_failure(run_dir, rank, code)
                return _left_early(run_dir, ended, cause) or cause
            if all(c == 0 for c in codes):
                return None
            time.sleep(0.05)
    finally:
        _stop(workers, signal.SIGKILL)  # nothing outlives the parent, whatever happened
        for s, h in old.items():
            signal.signal(s, h)


def rank_server(warm: bool, nproc: int, shared: bool) -> RankStarter | None:
    """What forks this launch's ranks, or None (not `warm`: a script task's, whose ranks never
    import torch; EXPGPU_WARM_RANKS=0): the server that EXPGPU_WARM_SERVER names
    (expgpu.launch.warm_server) when it may be `shared`, else one of this launch's own (expgpu.launch.warm)
    when there are several ranks to share its import. A shared server that refuses the launch
    leaves it to the latter, after a warning that says why."""
    chosen = os.environ.get(envvars.WARM_RANKS) or "1"
    if chosen not in ("0", "1"):
        raise UserError(f"{envvars.WARM_RANKS}={chosen!r} is not allowed: 1 (the default: a launch's ranks are forked "
                        "from one process that imported torch) or 0 (each rank starts fresh); unset it or fix it")
    if not warm or chosen == "0":
        return None
    from expgpu.launch import warm_client

    if shared and os.environ.get(warm_client.ENV):
        try:
            return warm_client.WarmServer(os.environ[warm_client.ENV], dict(os.environ))
        except (warm_client.Refused, OSError) as e:
            log.warning("%s=%s not used for this launch: %s", warm_client.ENV, os.environ[warm_client.ENV], e)
    if nproc < 2:
        return None
    from expgpu.launch.warm import WarmRanks

    try:
        return WarmRanks(dict(os.environ))
    except OSError as e:
        log.warning("ranks start one by one: the warm process did not start (%s)", e)
        return None


def _start(server: RankStarter | None, env: dict[str, str], run_dir: Path) -> ProcHandle:
    """One rank: forked from the warm server, else `python -m expgpu.launch.worker RUN_DIR`."""
    argv = [sys.executable, "-m", "expgpu.launch.worker", str(run_dir)]
    if server is not None:
        try:
            return server.start(env, ["expgpu.launch.worker", str(run_dir)])
        except OSError as e:   # it could not fork (a thread started at import), or is gone
            log.warning("rank started fresh: the warm process could not fork it (%s)", e)
    return subprocess.Popen(argv, env=env, preexec_fn=_child_setup, start_new_session=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now, for ranks that bind it themselves a moment later (torchrun's
    get_free_port does the same; another process may take it in between, as there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _record_killed(run_dir: Path, bad: list[tuple[int, int]], oom_counts: list[oom.OomCount]) -> None:
    """A failure record for each rank killed outright (a signal: the OOM killer, a segfault), which wrote none:
    its peers, whose collectives it tore down, read it and say one line naming it instead of a traceback each
    (expgpu.launch.worker). Before this supervisor stops anyone, so only a rank that died by itself."""
    for rank, code in bad:
        if code < 0 and failure_time(run_dir, rank) is None:
            try:
                write_failure(run_dir, rank, oom.killed_by(code, oom_counts[rank]), killed=True)
            except OSError:   # a full disk: its peers print what they caught, as before
                pass


def _left_early(run_dir: Path, ended: dict[int, float], failure: Failure) -> Failure | None:
    """The rank that ended first, with code 0, when the failure is a collective that lost its peer: a rank's
    process that ended early (os._exit(0) in the task) left the others waiting for it, and the first of them to
    notice would otherwise be blamed. None otherwise."""
    if not ended or not failure_record(run_dir, failure.rank).get("lost_peer"):
        return None
    return ended_early(min(ended, key=ended.get), failure.rank, failure.step)


def _failed(run_dir: Path, workers: list[ProcHandle], bad: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The failed ranks (rank, exit code): `bad`, which ended, and those that recorded a failure and still end.
    Where all of them are echoes (_echo), this waits up to CAUSE_WAIT_S for a rank's own record: a script task's
    rank records its own failure only once its peers' scripts have ended (expgpu.script.result.collect)."""
    deadline = time.monotonic() + CAUSE_WAIT_S
    while True:
        ended = {r for r, _ in bad}
        found = bad + [(r, 1) for r, p in enumerate(workers)
                       if r not in ended and p.poll() != 0 and failure_file(run_dir, r).exists()]
        if not all(_echo(run_dir, r) for r, _ in found) or time.monotonic() >= deadline or \
                all(p.poll() is not None for p in workers):
            return found
        time.sleep(0.02)


def _echo(run_dir: Path, rank: int) -> bool:
    """Its record is a collective that lost its peer: the echo of another rank's end, which its own record says
    (a rank that waited in collect for its peers' scripts records its own failure after theirs)."""
    return bool(failure_record(run_dir, rank).get("lost_peer"))


def _recorded(run_dir: Path, rank: int) -> float:
    """When `rank` recorded its failure; a rank killed outright recorded nothing: it went first."""
    at = failure_time(run_dir, rank)
    return float("-inf") if at is None else at
