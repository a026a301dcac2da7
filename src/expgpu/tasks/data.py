"""Synthetic datasets, generated from a seed so every rank builds the same examples."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset


class _Tensors(Dataset):
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i):
        return self.inputs[i], self.targets[i]


class SmoothRegression(_Tensors):
    """y = tanh(x A) B + noise: a smooth non-linear target an MLP can fit."""

    def __init__(self, size: int = 4096, in_features: int = 32, out_features: int = 4,
                 noise: float = 0.05, seed: int = 0, split_seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(in_features, 64, generator=g) / math.sqrt(in_features)
        b = torch.randn(64, out_features, generator=g) / 8.0
        # split_seed draws other inputs from the same function: a held-out split
        g_x = torch.Generator().manual_seed(seed * 1000 + split_seed + 1)
        x = torch.randn(size, in_features, generator=g_x)
        y = torch.tanh(x @ a) @ b + noise * torch.randn(size, out_features, generator=g_x)
        super().__init__(x, y)


class NoisyWaves(_Tensors):
    """Sequence classification: which of `classes` frequencies is hidden in the noise."""

    def __init__(self, size: int = 4096, length: int = 64, classes: int = 4,
                 noise: float = 0.8, seed: int = 0, split_seed: int = 0):
        g = torch.Generator().manual_seed(seed * 1000 + split_seed + 1)
        labels = torch.randint(0, classes, (size,), generator=g)
        t = torch.arange(length, dtype=torch.float32)
        freq = (labels.float() + 1.0).unsqueeze(1) * (2 * math.pi / length) * 2
        phase = torch.rand(size, 1, generator=g) * 2 * math.pi
        x = torch.sin(freq * t + phase) + noise * torch.randn(size, length, generator=g)
        super().__init__(x.unsqueeze(1), labels)  # (N, 1 channel, length)
