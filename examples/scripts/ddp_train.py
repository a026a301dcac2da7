"""A DDP training script written the usual way for torchrun, with a CPU fallback: nothing expgpu-specific.

    torchrun --nproc-per-node=2 examples/scripts/ddp_train.py --lr 0.05 --epochs 3
    python examples/scripts/ddp_train.py                                   # one process, no group
    python -m expgpu --config-dir examples/conf task=ddp_script launch.nproc_per_node=2   # the same, by expgpu

A linear regression on synthetic data: DistributedSampler shares out each epoch, DDP averages the
gradients, rank 0 prints and saves. At the end the ranks all-reduce their ranks and their parameters'
sum, and rank 0 writes both to --out (what the tests read to see that the ranks met in one group and
stayed in step). The one optional expgpu line, expgpu.log, does nothing where expgpu is absent or did
not start the script.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:
    from expgpu import log as expgpu_log
except ImportError:   # plain torchrun without expgpu installed
    def expgpu_log(**scalars):
        pass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", default="summary.json")
    args = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    y = x @ torch.arange(1.0, 9.0) + 0.1 * torch.randn(1024, generator=g)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset) if distributed else None
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(device)
    if distributed:
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = F.mse_loss(model(xb).squeeze(-1), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            expgpu_log(loss=loss.item(), step=step)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)

    summary = torch.tensor([float(rank), sum(p.sum().item() for p in model.parameters())], device=device)
    if distributed:
        gathered = [torch.zeros_like(summary) for _ in range(world)]
        dist.all_gather(gathered, summary)
    else:
        gathered = [summary]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "ranks": [int(t[0]) for t in gathered],
                       "param_sums": [t[1].item() for t in gathered], "final_loss": loss.item(), "steps": step}, f)
        torch.save(model.state_dict(), "model.pt")
    if distributed:
        dist.destroy_process_group()
        # torch 2.13: a gloo group DDP used outlives destroy_process_group, and a worker thread that
        # frees its last collective while the interpreter shuts down aborts the process (SIGABRT,
        # about 1 exit in 6 on 2 cores; pytorch PR #179291). Releasing the GIL once lets it finish.
        time.sleep(0.05)


if __name__ == "__main__":
    main()
