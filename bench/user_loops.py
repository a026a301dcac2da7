"""The same training loop twice, as task functions: once written plainly against torch (DDP,
DistributedSampler, its own epoch loop, loss.item() every log_every steps), once through the
Run API (run.wrap, run.loader, run.track, run.steps, run.log). bench_run_api.py times both
under the same expgpu launch, so the ratio is the Run API's own cost on the hot path.

Both clocks run from the end of step 10 to the end of the last step: run.steps' checkpoint at the
end of training (a plain loop would save one too, in its own way) is not in the rate."""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, DistributedSampler

from expgpu import Run
from expgpu.tasks.data import SmoothRegression
from expgpu.tasks.models import MLP


def plain(run: Run, steps: int = 3000, log_every: int = 10):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = MLP(32, 4, hidden=128)
    if run.world_size > 1:
        model = DDP(model)
    data = SmoothRegression(4096, 32, 4)
    sampler = DistributedSampler(data, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    step, epoch, t10 = 0, 0, None
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=64, sampler=sampler, drop_last=True):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            if step == 10:
                t10 = time.perf_counter()
            if step % log_every == 0 and run.rank == 0:
                loss.item()
            if step >= steps:
                break
        epoch += 1
    return {"steps_per_s": (steps - 10) / (time.perf_counter() - t10)}   # the last step just ended


def with_run(run: Run, steps: int = 3000):
    model = run.wrap(MLP(32, 4, hidden=128))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = run.loader(SmoothRegression(4096, 32, 4), batch_size=64)
    run.track(model=model, opt=opt)
    loss_fn = torch.nn.MSELoss()
    t10 = t_last = None
    for step, (x, y) in run.steps(loader, steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        run.log(loss=loss)
        if step == 9:
            t10 = time.perf_counter()
        t_last = time.perf_counter()
    return {"steps_per_s": (steps - 10) / (t_last - t10)}
