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



def _plain_half(run: Run, data, seed: int, precision: str = "32", hidden: int = 128, workers: int = 0):
    """A plainly written DDP loop over `data` (bench/plain_ddp.py's), run `chunk` steps at a time:
    (step(chunk)), on the run's device. precision bf16: the forward pass under torch.autocast, as such a
    script does. `workers`: DataLoader workers, kept for the whole run (persistent_workers), as a careful
    script keeps them."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    device = run.device   # as a plain script puts its model and batches on its GPU (the CPU in CPU runs)
    model = MLP(32, 4, hidden=hidden).to(device)
    if run.world_size > 1:
        model = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    sampler = DistributedSampler(data, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()

    loader = DataLoader(data, batch_size=64, sampler=sampler, drop_last=True, pin_memory=device.type == "cuda",
                        num_workers=workers, persistent_workers=workers > 0)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    it = batches()

    def steps(chunk: int) -> None:
        for i in range(chunk):
            x, y = next(it)
            if device.type != "cpu":
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else \
                    contextlib.nullcontext():
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if i % 10 == 9 and run.rank == 0:   # as the plain loop: loss.item() every 10 steps
                loss.item()

    return steps


def _run_half(run: Run, data, steps: int, hidden: int = 128):
    """The same loop through the Run API: one run.steps generator, advanced `chunk` steps at a time."""
    torch.manual_seed(1)
    model = run.wrap(MLP(32, 4, hidden=hidden))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    run.track(model=model, opt=opt)
    loss_fn = torch.nn.MSELoss()
    it = run.steps(run.loader(data, batch_size=64), steps)

    def advance(chunk: int) -> None:
        for _ in range(chunk):
            step, (x, y) = next(it)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            run.log(loss=loss)

    advance.rest = it   # run.steps ends the run its way once drained (the last step is done: it saves)
    return advance


def _ratios(times: tuple[list, list], chunk: int) -> dict:
    """Each loop's steps/s over all its chunks but the first pair's (warm-up), and the median of
    the per-pair ratios."""
    pairs = list(zip(*times))[1:]
    return {"plain_steps_per_s": chunk * len(pairs) / sum(p for p, _ in pairs),
            "run_steps_per_s": chunk * len(pairs) / sum(r for _, r in pairs),
            "ratio_median": statistics.median(p / r for p, r in pairs)}


def interleaved(run: Run, steps: int = 3000, chunk: int = 100, control: bool = False, hidden: int = 128):
    """Both loops in one process, taking turns every `chunk` steps (plain, Run, plain, ...): each
    pair of chunks runs within a fraction of a second, so machine noise (other processes, CPU
    frequency) hits both alike, where separate runs differ by 10-40 % on a small shared machine.
    The Run loop's stop poll, log flushes and progress lines fall in its chunks. control=True: the
    second loop is a plain one too (an A/A run: the noise floor of the ratio). Returns each loop's
    steps/s over all its chunks (the first pair warms up) and the median of the per-pair ratios. `hidden`: the
    MLP's width (128: the GPU idles, the CPU's work decides; 16384: the GPU's work does, so that a loop that
    waits for it, as the plain one's loss.item() does, leaves it idle meanwhile)."""
    data = SmoothRegression(4096, 32, 4)
    first = _plain_half(run, data, seed=0, hidden=hidden)
    second = _plain_half(run, data, seed=1, hidden=hidden) if control else _run_half(run, data, steps, hidden)
    times: tuple[list, list] = ([], [])
    wall0, watchdog0 = time.perf_counter(), _watchdog_cpu_s()
    for _ in range(steps // chunk):
        for half, spent in ((first, times[0]), (second, times[1])):
            _sync(run.device)
            t0 = time.perf_counter()
            half(chunk)
            _sync(run.device)
            spent.append(time.perf_counter() - t0)
    for _ in getattr(second, "rest", ()):
        pass
    watchdog = _watchdog_cpu_s()
    share = None if watchdog is None else (watchdog - watchdog0) / (time.perf_counter() - wall0)
    return {**_ratios(times, chunk), "watchdog_cpu_share": share}


def _sync(device) -> None:
    """On a GPU, each chunk's time ends when its queued kernels have run, not when they were queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _watchdog_cpu_s() -> float | None:
    """The CPU seconds the hang watchdog's thread has used in this process (None: it is not running):
    the most it can take from the loops, which share its process and its GIL."""
    import threading

    found = [t for t in threading.enumerate() if t.name == "expgpu-watchdog"]
    # the thread's own CPU clock (ns resolution; /proc's per-thread times count 10 ms ticks)
    return time.clock_gettime(time.pthread_getcpuclockid(found[0].ident)) if found else None


def builtin_interleaved(run: Run, precision: str, steps: int = 3000, chunk: int = 50):
    """expgpu's built-in loop (tasks.supervised, task a's model, data and optimizer) against the
    plain DDP loop of bench/plain_ddp.py, in the same processes, taking turns every `chunk` steps.
    The built-in loop keeps control: its run.steps generator is wrapped so that every `chunk`
    steps it runs a chunk of the plain loop before yielding the next batch. Each built-in chunk's
    time covers its step bodies and run.steps' own work between them (stop poll, log flushes,
    progress lines, fetching the batch). With data.num_workers > 0 both loops take their batches from
    that many DataLoader workers a rank, kept for the run (the built-in loop's own choice, and the plain
    loop's persistent_workers=True)."""
    import functools

    from expgpu.tasks import supervised

    data = SmoothRegression(4096, 32, 4)
    plain = _plain_half(run, data, seed=1, precision=precision, workers=run.cfg.data.num_workers)
    times: tuple[list, list] = ([], [])
    builtin_steps = run.steps

    def taking_turns(loader, max_steps, **kw):
        t = None
        for i, item in enumerate(builtin_steps(loader, max_steps, **kw)):
            if i and i % chunk == 0:
                _sync(run.device)
                times[1].append(time.perf_counter() - t)
                t0 = time.perf_counter()
                plain(chunk)
                _sync(run.device)
                times[0].append(time.perf_counter() - t0)
            if i % chunk == 0:
                _sync(run.device)
                t = time.perf_counter()
            yield item

    run.steps = taking_turns   # the instance's attribute, seen by supervised.train alone
    torch.manual_seed(0)
    supervised.train(run, model=MLP(32, 4, hidden=128), dataset=data,
                     optimizer=functools.partial(torch.optim.Adam, lr=1e-3), batch_size=64, max_steps=steps)
    return _ratios(times, chunk)
