"""scikit-learn's bundled 8x8 handwritten digits (1797 images): real data, no download."""

from __future__ import annotations

import torch

# At import, not in __init__: a gpu_pool sweep's fork server imports this module once for all its jobs
# (the task's _target_ modules are warmed), and sklearn's import is most of a job's start-up (~0.9 s).
from sklearn.datasets import load_digits

from expgpu.tasks.data import _Tensors


class Digits(_Tensors):
    def __init__(self, split: str = "train", test_fraction: float = 0.2, seed: int = 0):
        if split not in ("train", "test"):
            raise ValueError(f"Digits split={split!r}: use train or test")
        bunch = load_digits()
        x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
        y = torch.tensor(bunch.target, dtype=torch.long)
        # a fixed permutation (independent of the task seed) keeps the test split held out
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        n_test = int(len(x) * test_fraction)
        idx = order[:n_test] if split == "test" else order[n_test:]
        super().__init__(x[idx], y[idx])
