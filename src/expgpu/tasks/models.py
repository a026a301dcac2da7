"""Small models for the built-in tasks."""

from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    def __init__(self, in_features: int, out_features: int, hidden: int = 128, depth: int = 2):
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        super().__init__(*layers)


class WaveCNN(nn.Sequential):
    """1-D convolutions over a (N, 1, length) signal -> class logits."""

    def __init__(self, classes: int, channels: int = 32):
        super().__init__(
            nn.Conv1d(1, channels, kernel_size=7, padding=3), nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=5, padding=2, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool1d(8), nn.Flatten(),
            nn.Linear(channels * 8, classes),
        )
