"""The baseline: a plain PyTorch DDP script, as people write it by hand.

Same model, data, batch, optimizer and sampler as expgpu's task `a`. Started either by
torchrun (`torchrun --nproc-per-node=2 bench/plain_ddp.py STEPS`) or by itself with
torch.multiprocessing (`python bench/plain_ddp.py STEPS --spawn 2`). Prints one JSON
line from rank 0: absolute time of the first step, and steps/s after the first 10.
`--precision bf16` runs the forward pass under torch.autocast, as a mixed-precision script does.
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


def train(rank: int, world: int, steps: int, precision: str = "32") -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(MLP(32, 4, hidden=128))
    data = SmoothRegression(4096, 32, 4)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    step, epoch, t_first, t10 = 0, 0, time.time(), None
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=64, sampler=sampler, drop_last=True):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
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
    t_end = time.time()
    if rank == 0:
        print(json.dumps({"first_step_at": t_first, "steps_per_s": (steps - 10) / (t_end - t10)}), flush=True)
    dist.destroy_process_group()
    # torch 2.13: without this, 1 run in 6 aborts at exit (SIGABRT) under torchrun and
    # mp.spawn alike; expgpu.distributed.group._let_gloo_threads_finish says why. After the timing.
    time.sleep(0.05)


def _spawned(rank: int, world: int, steps: int, precision: str) -> None:
    train(rank, world, steps, precision)


if __name__ == "__main__":
    steps = int(sys.argv[1])
    precision = sys.argv[sys.argv.index("--precision") + 1] if "--precision" in sys.argv else "32"
    if "--spawn" in sys.argv:
        world = int(sys.argv[sys.argv.index("--spawn") + 1])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.multiprocessing.spawn(_spawned, args=(world, steps, precision), nprocs=world)
    else:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), steps, precision)
