"""The same training loop twice, as task functions: once written plainly against torch (DDP,
DistributedSampler, its own epoch loop, loss.item() every log_every steps), once through the
Run API (run.wrap, run.loader, run.track, run.steps, run.log). bench_run_api.py times both
under the same expgpu launch, so the ratio is the Run API's own cost on the hot path.

Both clocks run from the end of step 10 to the end of the last step: run.steps' checkpoint at the
end of training (a plain loop would save one too, in its own way) is not in the rate."""

from __future__ import annotations

import statistics
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


def interleaved(run: Run, steps: int = 3000, chunk: int = 100):
    """Both loops in one process, taking turns every `chunk` steps (plain, Run, plain, ...): each
    pair of chunks runs within a fraction of a second, so machine noise (other processes, CPU
    frequency) hits both alike, where separate runs differ by 10-40 % on a small shared machine.
    The Run loop is one run.steps generator advanced a chunk at a time; its stop poll, log flushes
    and progress lines fall in its chunks. Returns each loop's steps/s over all its chunks and the
    median of the per-pair ratios."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    data = SmoothRegression(4096, 32, 4)
    model_p = MLP(32, 4, hidden=128)
    if run.world_size > 1:
        model_p = DDP(model_p)
    sampler = DistributedSampler(data, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=0)
    opt_p = torch.optim.Adam(model_p.parameters(), lr=1e-3)
    model_r = run.wrap(MLP(32, 4, hidden=128))
    opt_r = torch.optim.Adam(model_r.parameters(), lr=1e-3)
    loader_r = run.loader(data, batch_size=64)
    run.track(model=model_r, opt=opt_r)
    loss_fn = torch.nn.MSELoss()

    def plain_batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from DataLoader(data, batch_size=64, sampler=sampler, drop_last=True)
            epoch += 1

    plain_it, run_it = plain_batches(), run.steps(loader_r, steps)
    times = {"plain": [], "run": []}
    for turn in range(2 * (steps // chunk)):
        t0 = time.perf_counter()
        if turn % 2 == 0:
            for i in range(chunk):
                x, y = next(plain_it)
                opt_p.zero_grad(set_to_none=True)
                loss = loss_fn(model_p(x), y)
                loss.backward()
                opt_p.step()
                if i % 10 == 9 and run.rank == 0:   # as the plain loop: loss.item() every 10 steps
                    loss.item()
        else:
            for _ in range(chunk):
                step, (x, y) = next(run_it)
                opt_r.zero_grad(set_to_none=True)
                loss = loss_fn(model_r(x), y)
                loss.backward()
                opt_r.step()
                run.log(loss=loss)
        times["plain" if turn % 2 == 0 else "run"].append(time.perf_counter() - t0)
    for _ in run_it:   # run.steps ends the run its way (the last step is done; this saves)
        pass
    pairs = list(zip(times["plain"], times["run"]))[1:]   # the first pair warms up
    return {"plain_steps_per_s": chunk * len(pairs) / sum(p for p, _ in pairs),
            "run_steps_per_s": chunk * len(pairs) / sum(r for _, r in pairs),
            "ratio_median": statistics.median(p / r for p, r in pairs)}
