"""2-rank DDP runs over gloo through expgpu.distributed.group.process_group, each rank ending the way a plain
script does: returning, so the interpreter shuts down (tests/distributed/test_teardown.py).

    python tests/helpers/teardown_probe.py RUNS RUN_DIR [--no-drain]

torch is imported once; each rank of each run is a fork of this process that trains, returns
and goes through the interpreter's own shutdown (where the abort happens), so a run costs its
training and exit, not two torch imports. Prints one line per rank that did not exit cleanly (an abort,
an error, or a hang at exit, which a forked rank can show instead of the abort); exit 1 if any.
--no-drain turns off group._let_gloo_threads_finish, to see the abort it prevents.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

from expgpu.distributed import group
from expgpu.ranks import RankInfo

HANG_S = 30.0   # a rank trains and exits in about a second


def train(rank: int, run_dir: Path) -> None:
    info = RankInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0,
                    master_addr="127.0.0.1", master_port=0, source="local")
    torch.manual_seed(0)
    with group.process_group(info, "gloo", 60, run_dir):
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(20):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()


def main() -> int:
    runs, root = int(sys.argv[1]), Path(sys.argv[2])
    if "--no-drain" in sys.argv:
        group._let_gloo_threads_finish = lambda: None
    # The first optimizer step imports torch._dynamo (about a second): once, here, not in every rank
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1).step()
    failed = 0
    for n in range(runs):
        run_dir = root / f"run{n}"
        run_dir.mkdir(parents=True)
        pids = {}
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:   # the rank: train, then leave through the interpreter's shutdown
                train(rank, run_dir)
                raise SystemExit(0)
            pids[pid] = rank
        for pid, rank in pids.items():
            how = ended(pid)
            if how:
                failed += 1
                print(f"run {n} rank {rank}: {how}", flush=True)
    return 1 if failed else 0


def ended(pid: int) -> str | None:
    """None for a clean exit, else how the rank ended; one still alive after HANG_S is killed."""
    deadline = time.monotonic() + HANG_S
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"hung for {HANG_S:.0f}s at exit (killed)"
        time.sleep(0.02)
    status = done[1]
    if status == 0:
        return None
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


if __name__ == "__main__":
    sys.exit(main())
