"""A dataset for the shard tests that records which examples each rank fetched
(`_target_: shard_probe.IndexLog`, with tests/ on PYTHONPATH)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset


class IndexLog(Dataset):
    """x = a fixed random vector, y = a fixed function of it; every fetch appends its index to
    LOG_DIR/rank<R>.txt, R from the EXPGPU_RANK that expgpu's spawn sets."""

    def __init__(self, log_dir: str, size: int = 256, in_features: int = 32, out_features: int = 4):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, in_features, generator=g)
        self.y = torch.tanh(self.x[:, :out_features])
        self.log_dir = Path(log_dir)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"rank{os.environ.get('EXPGPU_RANK', '0')}.txt", "a") as f:
            f.write(f"{int(i)}\n")
        return self.x[i], self.y[i]


class MeanClaimingSum(torch.nn.Module):
    """An MSE mean that claims to be a sum, so expgpu leaves its loss unweighted: what
    proportional batches without the weighting would compute (a negative control)."""

    reduction = "sum"

    def forward(self, output, target):
        return torch.nn.functional.mse_loss(output, target)
