"""Task functions for bench_fsdp.py: a small GPT-like model (examples/my_tasks/charlm.py's
CharTransformer: token + position embeddings, pre-norm Transformer blocks, a head) trained on
random tokens, (a) through run.wrap with launch.wrap=fsdp against the same model sharded by hand
with fully_shard in a plain loop, (b) the parameter and optimizer bytes a rank holds, (c) the
training stall of a periodic checkpoint."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from my_tasks.charlm import CharTransformer, Chunks
from torch.utils.data import DataLoader, DistributedSampler

from expgpu import Run
from expgpu.distributed import fsdp
from user_loops import _ratios

VOCAB = 96


def _model(width: int, layers: int, block: int, seed: int) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(VOCAB, block, width, layers, heads=4, dropout=0.0)


def _data(block: int) -> Chunks:
    g = torch.Generator().manual_seed(0)
    return Chunks(torch.randint(VOCAB, (block * 4096 + 1,), generator=g), block)


def _step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def _plain_half(run: Run, data, batch: int, width: int, layers: int, block: int):
    """FSDP2 as its tutorial writes it: fully_shard on each Transformer block, then the root; a
    DistributedSampler, loss.item() every 10 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(width, layers, block, seed=1)
    mesh = init_device_mesh("cpu", (run.world_size,))
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=1)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)
            epoch += 1

    it = batches()

    def steps(chunk: int) -> None:
        for i in range(chunk):
            x, y = next(it)
            loss = _step(model, opt, x, y)
            if i % 10 == 9 and run.rank == 0:
                loss.item()

    return steps


def _run_half(run: Run, data, batch: int, width: int, layers: int, block: int, total: int):
    """The same through the Run API: run.wrap (launch.wrap=fsdp, launch.fsdp.units), run.loader,
    run.track, run.steps, run.log."""
    model = run.wrap(_model(width, layers, block, seed=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.track(model=model, opt=opt)
    it = run.steps(run.loader(data, batch_size=batch), total)

    def advance(chunk: int) -> None:
        for _ in range(chunk):
            step, (x, y) = next(it)
            run.log(loss=_step(model, opt, x, y))

    advance.rest = it
    return advance


def wrap_vs_plain(run: Run, steps: int = 300, chunk: int = 25, batch: int = 8, width: int = 64,
                  layers: int = 4, block: int = 32, run_first: bool = False):
    """Both loops in the same processes, taking turns every `chunk` steps (as user_loops.interleaved);
    run_first: the Run loop's chunk first in each pair (the bench alternates, against an order bias)."""
    data = _data(block)
    first = _plain_half(run, data, batch, width, layers, block)
    second = _run_half(run, data, batch, width, layers, block, steps)
    times: tuple[list, list] = ([], [])
    turns = ((first, times[0]), (second, times[1]))
    for _ in range(steps // chunk):
        for half, spent in (turns[::-1] if run_first else turns):
            t0 = time.perf_counter()
            half(chunk)
            spent.append(time.perf_counter() - t0)
    for _ in second.rest:
        pass
    return _ratios(times, chunk)


def held_bytes(run: Run, batch: int = 8, width: int = 256, layers: int = 4, block: int = 64):
    """The parameter and AdamW-state bytes this rank holds after a step (its local shards under fsdp)."""
    model = run.wrap(_model(width, layers, block, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.track(model=model, opt=opt)
    for step, (x, y) in run.steps(run.loader(_data(block), batch_size=batch), 2):
        _step(model, opt, x, y)
    params, state = fsdp.held_bytes(model, opt)
    mine = {"params": params, "optimizer": state}
    every = run.all_reduce({k: float(v) for k, v in mine.items()}, op="max")   # the peak over ranks
    return {f"max_rank_{k}_bytes": v for k, v in every.items()}


def save_stall(run: Run, steps: int = 120, batch: int = 8, width: int = 192, layers: int = 4, block: int = 32):
    """Each step's time in run.steps between two step bodies: where a checkpoint.every_steps save
    happens. Returns the stall per save (its gap less a plain step's) and the whole run's time per
    save beyond its steps (a background write slowing the steps around it shows there)."""
    model = run.wrap(_model(width, layers, block, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.track(model=model, opt=opt)
    every = run.cfg.checkpoint.every_steps
    gaps, bodies, t_end = [], [], None
    t_start = time.perf_counter()
    for step, (x, y) in run.steps(run.loader(_data(block), batch_size=batch), steps):
        t0 = time.perf_counter()
        if t_end is not None:
            gaps.append((step, t0 - t_end))
        _step(model, opt, x, y)
        t_end = time.perf_counter()
        bodies.append(t_end - t0)
    total = t_end - t_start
    at_save = [g for s, g in gaps if s % every == 0 and s > every]   # the first save's staging warms up
    other = [g for s, g in gaps if s % every != 0]
    stall = statistics.mean(at_save) - statistics.median(other)
    saves = len(at_save) + 1
    beyond = (total - len(bodies) * statistics.median(bodies) - sum(other)) / saves
    return {"stall_per_save_s": stall, "time_per_save_s": beyond, "step_s": statistics.median(bodies)}
