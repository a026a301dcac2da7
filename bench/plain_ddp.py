"""The baseline: a plain PyTorch DDP script, as people write it by hand.

Same model, data, batch, optimizer and sampler as expgpu's task `a`. Started either by
torchrun (`torchrun --nproc-per-node=2 bench/plain_ddp.py STEPS`) or by itself with
torch.multiprocessing (`python bench/plain_ddp.py STEPS --spawn 2`). Prints one JSON
line from rank 0: absolute time of the first step, and steps/s after the first 10.
`--precision bf16` runs the forward pass under torch.autocast, as a mixed-precision script does.
`--device cuda`: each rank on its GPU over nccl, its batches pinned and copied as such a script does;
`python bench/plain_ddp.py STEPS --device cuda` alone is a one-GPU script (no process group, no DDP).
`--workers N`: N DataLoader workers, kept for the whole run (persistent_workers), as a careful script keeps
them; `--fresh-workers` with it: started again each epoch, PyTorch's default.
"""

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from expgpu.tasks.data import SmoothRegression
from expgpu.tasks.models import MLP


def train(rank: int, world: int, steps: int, precision: str = "32", device: str = "cpu", workers: int = 0,
          fresh: bool = False) -> None:
    """device cuda: this rank's GPU (cuda:LOCAL_RANK) and nccl. One rank started on its own (no RANK, no
    --spawn): no process group and no DDP, as a one-GPU script is written."""
    cuda = device == "cuda"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    single = world == 1 and "RANK" not in os.environ
    if not single:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MLP(32, 4, hidden=128).to(dev)
    if not single:
        model = DDP(model, device_ids=[dev] if cuda else None)
    data = SmoothRegression(4096, 32, 4)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    loader = DataLoader(data, batch_size=64, sampler=sampler, drop_last=True, pin_memory=cuda, num_workers=workers,
                        persistent_workers=workers > 0 and not fresh)
    step, epoch, t_first, t10 = 0, 0, time.time(), None
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if cuda:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            if step == 10:
                t10 = time.time()
            if step % 10 == 0 and rank == 0:
                loss.item()  # what a logging line costs
            if step >= steps:
                break
        epoch += 1
    if cuda:
        torch.cuda.synchronize(dev)
    t_end = time.time()
    if rank == 0:
        print(json.dumps({"first_step_at": t_first, "steps_per_s": (steps - 10) / (t_end - t10)}), flush=True)
    if single:
        return
    dist.destroy_process_group()
    # torch 2.13: without this, 1 run in 6 aborts at exit (SIGABRT) under torchrun and
    # mp.spawn alike; expgpu.distributed.group._let_gloo_threads_finish says why. After the timing.
    time.sleep(0.05)


def _spawned(rank: int, world: int, steps: int, precision: str, device: str, workers: int, fresh: bool) -> None:
    train(rank, world, steps, precision, device, workers, fresh)


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    steps = int(sys.argv[1])
    precision, device = _option("--precision", "32"), _option("--device", "cpu")
    workers, fresh = int(_option("--workers", "0")), "--fresh-workers" in sys.argv
    if "--spawn" in sys.argv:
        world = int(_option("--spawn", "2"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.multiprocessing.spawn(_spawned, args=(world, steps, precision, device, workers, fresh), nprocs=world)
    else:   # under torchrun, or alone (one process: no process group)
        train(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), steps, precision, device,
              workers, fresh)
