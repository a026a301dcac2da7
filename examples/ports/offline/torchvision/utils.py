"""utils.save_image: a batch of 1xHxW images in [0, 1] as one PNG grid, `nrow` images a row."""

import math

import torch


def save_image(tensor, fp, nrow=8, padding=2):
    from PIL import Image

    images = tensor.detach().cpu().clamp(0, 1)
    n, _, h, w = images.shape
    cols = min(nrow, n)
    rows = math.ceil(n / cols)
    grid = torch.zeros(rows * (h + padding) + padding, cols * (w + padding) + padding)
    for i in range(n):
        r, c = divmod(i, cols)
        top, left = padding + r * (h + padding), padding + c * (w + padding)
        grid[top:top + h, left:left + w] = images[i, 0]
    Image.fromarray((grid * 255).round().byte().numpy(), mode="L").save(fp)
