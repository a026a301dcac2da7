"""Local ranks forked from one warm process: torch imported once per launch, not once per rank.

A rank's start-up is mostly importing torch and torch._dynamo (which the first optimizer step
pulls in): 2-3 CPU-seconds, paid by every rank of `launch.nproc_per_node=N` at once, on the cores
the ranks then train on. expgpu.launch.spawn instead starts one server (`python -m expgpu.launch.warm FD`)
that imports them, then forks each rank from it: the ranks share its memory copy-on-write and
start warm. The fork server is the gpu_pool's (expgpu.procs.forkserver: its protocol, reaping and
exit codes serve here too), warmed with what every rank imports (expgpu.task.RANK_IMPORTS).

Forking is safe because the server starts no Python thread, no OpenMP pool and no CUDA (CUDA
reads CUDA_VISIBLE_DEVICES when it initializes, in the rank, after its mask is set). What a fresh
process reads at start-up is set in the rank: its environment (os.environ, which also sets the C
environment CUDA and NCCL read later), its argv, its RNGs' seeds from the OS, and torch's CPU
threads (OpenMP read OMP_NUM_THREADS when the server loaded it). Stop signals are blocked from the
server's start, so a rank holds one that arrives before its handler is in (as spawn's
block_in_child does for a started rank).

Each rank is a fork of the server, in a session of its own, and dies with it (PR_SET_PDEATHSIG);
the server dies with the supervisor. A server that cannot fork (a thread started at import) or
does not start leaves spawn to start the ranks one by one, as before; so does EXPGPU_WARM_RANKS=0.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

from expgpu import envvars, procs
from expgpu.procs import forkserver, stop_signals
from expgpu.procs.forkserver import ForkedProc, ForkServer
from expgpu.task import RANK_IMPORTS


class WarmRanks:
    """The supervisor's side: one server per launch, a forked rank per call."""

    def __init__(self, env: dict[str, str]):
        self.server = ForkServer(None, {**env, envvars.WARM_PARENT: str(os.getpid())}, RANK_IMPORTS,
                                 module="expgpu.launch.warm")

    def start(self, env: dict[str, str], argv: list[str]) -> ForkedProc:
        """A rank with this environment and sys.argv, forked from the server (raises OSError if it cannot)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = self.server.fork(theirs)
            ours.sendall(json.dumps({"env": env, "argv": argv}).encode())
            proc.pid   # waits for the fork: an OSError now, while spawn can still start it by hand
        finally:
            ours.close()
            theirs.close()
        return proc

    def close(self) -> None:
        self.server.close()


def rank(sock: socket.socket) -> None:
    """A forked rank (the server's `spare`): take its environment and argv, then run."""
    msg = sock.recv(1 << 22)
    sock.close()
    if not msg:
        os._exit(0)   # the supervisor hung up before this rank got its job
    job = json.loads(msg)
    run_rank(job["env"], job["argv"])


def run_rank(env: dict[str, str], argv: list[str]) -> None:
    """In a fork (of this launch's server, or of expgpu.launch.warm_server's): run as
    `python -m expgpu.launch.worker RUN_DIR` would, in a fresh process with this environment."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv
    import random

    random.seed()   # seeded from the OS, as a fresh process; the server's state is every fork's
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    from expgpu.launch import worker

    try:
        worker.main()   # ends in procs.fast_exit
    except SystemExit as e:   # as the interpreter would end a fresh process: not the fork's os._exit(1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        procs.fast_exit(e.code if isinstance(e.code, int) else int(e.code is not None))
    except BaseException:
        traceback.print_exc()
        procs.fast_exit(1)


def main() -> None:
    stop_signals.block_in_child()   # the ranks inherit it: a stop signal waits for its handler
    parent = os.environ.pop(envvars.WARM_PARENT, None)
    procs.die_with_parent(int(parent) if parent else None)
    forkserver.serve(socket.socket(fileno=int(sys.argv[-1])),
                     lambda modules, path, context: forkserver.warm_imports(modules, path), rank)


if __name__ == "__main__":
    main()

