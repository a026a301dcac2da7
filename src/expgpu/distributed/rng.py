"""Every random number generator a training step may draw from: seeded, captured, restored.

Exact resume needs the state of each generator a user's code may touch, not only torch's:
Python's `random` (augmentation libraries), NumPy's global generator, torch's CPU generator and
the CUDA generator of this rank's device. States are kept as tensors and plain containers, so a
checkpoint that holds them still loads with torch.load(weights_only=True).
"""

from __future__ import annotations

import random
from typing import Any


def seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also every CUDA device's generator


def seed_cpu(seed: int) -> None:
    """Python's, NumPy's and torch's CPU generator only: what a DataLoader worker draws from.
    ~15 us, against ~125 us for torch.manual_seed, which also visits every accelerator backend."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


def capture(device) -> dict[str, Any]:
    import numpy as np
    import torch

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(words), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
