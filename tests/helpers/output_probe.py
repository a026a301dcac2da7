"""What ranks print, for tests/launch/test_output.py: many lines from every rank at once, and a line that
must reach the console while its rank still runs. `python output_probe.py` is the same as a torchrun-style
script (its own process group)."""

from __future__ import annotations

import time
from pathlib import Path

LINE = "rank {rank} line {i} " + "x" * 40   # each line whole: what the test looks for


def chatty(run, lines: int = 300):
    """Every rank prints `lines` lines, the ranks in step (a barrier every 10), so their writes meet."""
    _chatter(run.rank, lines, run.barrier)


def waits_for_go(run, wait_s: float = 60.0):
    """Prints that it is ready, then waits for the test (which saw the line) to write `go` in the run dir."""
    print(f"ready {run.rank}")
    go = Path(run.run_dir) / "go"
    deadline = time.monotonic() + wait_s
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"saw_go": float(go.exists())}


def _chatter(rank: int, lines: int, barrier) -> None:
    for i in range(lines):
        if i % 10 == 0:
            barrier()
        print(LINE.format(rank=rank, i=i))


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    _chatter(dist.get_rank(), 300, dist.barrier)
    dist.destroy_process_group()
