"""A DDP training script that is a Hydra app, written the usual way for torchrun (as pytorch/examples'
distributed/minGPT-ddp is): nothing expgpu-specific but the optional expgpu.log line.

    torchrun --nproc-per-node=2 examples/scripts/hydra_train/train.py optim=adam train.epochs=5
    python -m expgpu --config-dir examples/conf task=hydra_script launch.nproc_per_node=2   # by expgpu

A linear regression on synthetic data, its optimizer a config group (optim=sgd|adam). Rank 0 saves a
snapshot (model, optimizer, epochs done) after each epoch to train.snapshot, and a start that finds
one resumes from it, as minGPT-ddp's Trainer does. At the end the ranks all-gather their ranks and
their parameters' sum, and rank 0 writes them to `out` with the config it ran.
"""

import json
import os
import time

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:
    from expgpu import log as expgpu_log
except ImportError:   # plain torchrun without expgpu installed
    def expgpu_log(**scalars):
        pass


def optimizer(cfg: DictConfig, params):
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    distributed = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device
                                if device.type == "cuda" else None)
    rank = dist.get_rank() if distributed else 0

    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.data.samples, 8, generator=g)
    y = x @ torch.arange(1.0, 9.0) + cfg.data.noise * torch.randn(cfg.data.samples, generator=g)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset) if distributed else None
    loader = DataLoader(dataset, batch_size=cfg.train.batch_size, sampler=sampler, shuffle=sampler is None)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(device)
    opt = optimizer(cfg.optim, model.parameters())
    done = 0
    if os.path.exists(cfg.train.snapshot):   # every rank loads it: DDP then starts them equal
        snap = torch.load(cfg.train.snapshot, map_location=device)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        done = snap["epochs"]
        print(f"rank {rank}: resuming from {cfg.train.snapshot} after epoch {done}", flush=True)
    if distributed:
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    raw = model.module if distributed else model

    first = step = done * len(loader)
    for epoch in range(done, cfg.train.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.mse_loss(model(xb.to(device)).squeeze(-1), yb.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            expgpu_log(loss=loss.item(), step=step)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
            tmp = f"{cfg.train.snapshot}.tmp"
            torch.save({"model": raw.state_dict(), "optimizer": opt.state_dict(), "epochs": epoch + 1}, tmp)
            os.replace(tmp, cfg.train.snapshot)

    summary = torch.tensor([float(rank), sum(p.sum().item() for p in model.parameters())], device=device)
    gathered = [torch.zeros_like(summary) for _ in range(dist.get_world_size())] if distributed else [summary]
    if distributed:
        dist.all_gather(gathered, summary)
    if rank == 0:
        with open(cfg.out, "w") as f:
            json.dump({"ranks": [int(t[0]) for t in gathered], "param_sums": [t[1].item() for t in gathered],
                       "resumed_after": done, "steps": step - first, "cwd": os.getcwd(),
                       "config": OmegaConf.to_container(cfg)}, f)
    if distributed:
        dist.destroy_process_group()
        time.sleep(0.05)   # torch 2.13's gloo teardown race: see examples/scripts/ddp_train.py


if __name__ == "__main__":
    main()
