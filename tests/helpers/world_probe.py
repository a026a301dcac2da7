"""A task function for the resume-on-another-world-size tests (tests/checkpoint/test_world_change.py): it
writes the ids of the samples each rank trains on at each step, and logs the global batch's loss."""

from __future__ import annotations

import json
import math

import torch

from expgpu import Run


class Indexed(torch.utils.data.Dataset):
    """Sample i is (i, x_i, y_i), fixed by i: the ids say exactly which samples a step took."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.tensor([math.sin(i), math.cos(i), i / self.n, 1.0])
        return i, x, torch.tensor([math.sin(2.0 * i) + 0.3 * math.cos(i)])


def world_ids(run: Run, max_steps: int = 30, batch_size: int = 8, n: int = 200, own: bool = False, epochs: int = 0):
    """batch_size per rank at the run's start; `own`: a tracked dict whose value differs between ranks;
    `epochs` > 0: a loop over that many epochs (run.epochs) instead of max_steps steps."""
    model = run.wrap(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    counts = {"steps": 0, "rank": run.rank if own else 0}   # each rank's own; equal unless `own`
    run.track(model=model, opt=opt, counts=counts)
    loader = run.loader(Indexed(n), batch_size=batch_size)
    loss = torch.zeros(())
    with open(run.run_dir / f"ids.rank{run.rank}.w{run.world_size}.jsonl", "a") as seen:
        for ids, x, y in _batches(run, loader, max_steps, epochs):
            seen.write(json.dumps({"step": run.step, "ids": ids.tolist()}) + "\n")
            seen.flush()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            counts["steps"] += 1
            run.log(loss=run.all_reduce(loss.detach(), "mean"))   # the whole global batch's loss
    return {"loss": float(run.all_reduce(loss.detach(), "mean")), "batch": loader.batch_size,
            "steps_here": counts["steps"], "rank_batch": run.rank_batch(batch_size),
            "start_world": run.start_world_size}


def _batches(run: Run, loader, max_steps: int, epochs: int):
    if not epochs:
        for _, batch in run.steps(loader, max_steps):
            yield batch
        return
    for _ in run.epochs(epochs):
        for _, batch in run.steps(loader):
            yield batch
