"""datasets.MNIST: the raw idx files under ROOT/MNIST/raw, as torchvision reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _idx(path: Path, header: int) -> np.ndarray:
    raw = path.read_bytes()
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(header)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * header).reshape(dims)


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        raw = Path(root) / "MNIST" / "raw"
        prefix = "train" if train else "t10k"
        self.data = torch.from_numpy(_idx(raw / f"{prefix}-images-idx3-ubyte", 3).copy())
        self.targets = torch.from_numpy(_idx(raw / f"{prefix}-labels-idx1-ubyte", 1).astype(np.int64))
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        from PIL import Image

        img, target = Image.fromarray(self.data[index].numpy(), mode="L"), int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
