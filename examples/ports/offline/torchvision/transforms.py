"""transforms.ToTensor: a greyscale PIL image as a 1xHxW float tensor in [0, 1]."""

import numpy as np
import torch


class ToTensor:
    def __call__(self, pic):
        return torch.from_numpy(np.array(pic, dtype=np.uint8)).float().div(255).unsqueeze(0)
