"""A task whose rank `rank` takes `gb` GiB of memory at its first step (tests/launch/test_oom.py runs it under a
memory limit: the kernel's OOM killer ends that rank)."""

import torch


def hog(run, rank: int = 1, gb: float = 3.0):
    model = run.wrap(torch.nn.Linear(4, 1))
    for step, _ in run.steps(None, 5):
        if step == 1 and run.rank == rank:
            torch.ones(int(gb * 2**30) // 4)   # written, so the pages are the process's
        model(torch.randn(8, 4)).sum().backward()
    return {}
