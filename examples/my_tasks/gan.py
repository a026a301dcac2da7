"""A GAN learns a ring of 8 Gaussians: two models, two optimizers, alternating steps.

Written as a GAN is usually written in PyTorch; what expgpu changed is marked `# expgpu`:
the function takes `run` first, models go through run.wrap, the loader through run.loader,
the loop through run.steps, and the states to keep through run.track.

    PYTHONPATH=examples python -m expgpu --config-dir examples/conf task=gan
    PYTHONPATH=examples python -m expgpu --config-dir examples/conf task=gan task.lr_d=1e-3 launch.nproc_per_node=2
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

from expgpu import Run


def ring(n: int, modes: int = 8, radius: float = 2.0, std: float = 0.05, seed: int = 0) -> TensorDataset:
    """n points around `modes` Gaussians on a circle (its own generator: the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    which = torch.randint(0, modes, (n,), generator=g)
    angle = which.float() * (2 * math.pi / modes)
    centers = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return TensorDataset(centers + std * torch.randn(n, 2, generator=g))


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden),
                         nn.LeakyReLU(0.2), nn.Linear(hidden, outputs))


def mode_coverage(points: torch.Tensor, modes: int = 8, radius: float = 2.0, std: float = 0.05) -> dict:
    """How many modes get at least 1% of the samples within 4 std, and the share of such samples."""
    angle = torch.arange(modes, dtype=torch.float32) * (2 * math.pi / modes)
    centers = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    dist, nearest = torch.cdist(points, centers).min(dim=1)
    good = dist < 4 * std
    counts = torch.bincount(nearest[good], minlength=modes)
    return {"modes_covered": int((counts >= 0.01 * len(points)).sum()),
            "high_quality": float(good.float().mean())}


def train(run: Run, max_steps: int = 1500, batch_size: int = 128, lr_g: float = 1e-3, lr_d: float = 1e-3,
          z_dim: int = 8, hidden: int = 128, examples: int = 8192):
    generator = run.wrap(mlp(z_dim, hidden, 2))                              # expgpu: was .to(device) + DDP
    critic = run.wrap(mlp(2, hidden, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=lr_g, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(critic.parameters(), lr=lr_d, betas=(0.5, 0.999))
    loader = run.loader(ring(examples), batch_size)                         # expgpu: was DataLoader + sampler
    run.track(generator=generator, critic=critic, opt_g=opt_g, opt_d=opt_d)  # expgpu: the checkpoint
    bce = nn.BCEWithLogitsLoss()

    for step, (real,) in run.steps(loader, max_steps):                      # expgpu: was for epoch / for batch
        n = len(real)
        ones = torch.ones(n, 1, device=run.device)
        zeros = torch.zeros(n, 1, device=run.device)
        fake = generator(torch.randn(n, z_dim, device=run.device))

        # the critic: real -> 1, fake -> 0, in one forward (DDP: one forward per backward)
        loss_d = bce(critic(torch.cat([real, fake.detach()])), torch.cat([ones, zeros]))
        opt_d.zero_grad(set_to_none=True)
        loss_d.backward()
        opt_d.step()

        # the generator: make the critic call the fakes real
        loss_g = bce(critic(fake), ones)
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
        run.log(loss_d=loss_d, loss_g=loss_g)                               # expgpu: was print every N steps

    with torch.no_grad():
        samples = generator(torch.randn(4000, z_dim, device=run.device)).float().cpu()
    return {"loss_d": loss_d.item(), "loss_g": loss_g.item(), **mode_coverage(samples)}
