"""scikit-learn's bundled 8x8 handwritten digits (1797 images): real data, no download."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from expgpu.tasks.data import _Tensors


def _bundled_csv() -> Path | None:
    """The file sklearn.datasets.load_digits reads, found without importing sklearn (~0.9 s, most of a
    job's start-up): None where this sklearn keeps it elsewhere."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


@functools.cache
def images():
    """(1797 x 64 pixels scaled to [0, 1], 1797 labels) as numpy arrays, parsed once per process.

    numpy, not torch: a torch op on this many elements starts torch's OpenMP pool, and a process forked
    from one that started it (a gpu_pool fork server imports this module) hangs at its own first
    parallel op."""
    import numpy as np

    path = _bundled_csv()
    if path is not None:   # load_digits' own format: 64 pixel columns (0-16), then the label
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
        pixels, labels = table[:, :-1], table[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, labels = bunch.data, bunch.target
    return (pixels / 16.0).astype(np.float32), labels.astype(np.int64)


# At import: a gpu_pool sweep's fork server imports this module once for all its jobs (the task's
# _target_ modules are warmed), so each job's process is forked with the images parsed (~20 ms a
# split otherwise, twice per job).
images()


class Digits(_Tensors):
    def __init__(self, split: str = "train", test_fraction: float = 0.2, seed: int = 0):
        if split not in ("train", "test"):
            raise ValueError(f"Digits split={split!r}: use train or test")
        pixels, labels = images()
        x, y = torch.from_numpy(pixels), torch.from_numpy(labels)   # shared, not copied: indexed below
        # a fixed permutation (independent of the task seed) keeps the test split held out
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        n_test = int(len(x) * test_fraction)
        idx = order[:n_test] if split == "test" else order[n_test:]
        super().__init__(x[idx], y[idx])
