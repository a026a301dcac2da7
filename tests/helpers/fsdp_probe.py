"""Task functions of one's own for tests/distributed/test_fsdp.py (`--config-dir tests/conf`, tests/ on PYTHONPATH)."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from expgpu import Run
from expgpu.distributed.fsdp import held_bytes


def _mlp(width: int, depth: int, out: int = 1) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, out))


def two_models(run: Run, max_steps: int = 30, width: int = 16, batch: int = 8, lr: float = 1e-2):
    """Two modules and two optimizers, as a GAN's loop has them (each rank draws its own data).
    The generator's width may come from PROBE_WIDTH (code changed between a stop and its resume)."""
    noise = int(os.environ.get("PROBE_WIDTH", width))
    gen = run.wrap(_mlp(noise, 2, out=width))
    disc = run.wrap(_mlp(width, 2))
    opt_g = torch.optim.AdamW(gen.parameters(), lr=lr)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=lr)
    run.track(gen=gen, disc=disc, opt_g=opt_g, opt_d=opt_d)
    for step, _ in run.steps(None, max_steps):
        z = torch.randn(batch, noise)
        real = torch.randn(batch, width) * 0.5 + 1.0
        fake = gen(z)
        loss_d = (disc(real) - 1).pow(2).mean() + disc(fake.detach()).pow(2).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = (disc(fake) - 1).pow(2).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        run.log(loss_d=loss_d, loss_g=loss_g)
    return {"loss_g": float(loss_g.detach())}


def memory(run: Run, width: int = 256, depth: int = 4, max_steps: int = 1):
    """This rank's parameter and optimizer-state bytes (the local shards) after a step, in bytes<rank>.json."""
    model = run.wrap(_mlp(width, depth, out=width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.track(model=model, opt=opt)
    for step, _ in run.steps(None, max_steps):
        loss = model(torch.randn(4, width)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    params, state = held_bytes(model, opt)
    (run.run_dir / f"bytes{run.rank}.json").write_text(json.dumps({"params": params, "optimizer": state}))
    return {"params_bytes": params, "optimizer_bytes": state}


def shards_itself(run: Run, max_steps: int = 10, width: int = 16, batch: int = 8, wrap_too: bool = False):
    """FSDP2 as the task's own code does it (pytorch/examples' distributed/FSDP2): fully_shard on each
    layer, then the model, under launch.wrap=ddp; run.wrap not called (`wrap_too`: called on it)."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp(width, 2).to(run.device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    if wrap_too:
        model = run.wrap(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    run.track(model=model, opt=opt)
    for _ in run.steps(None, max_steps):
        x = torch.randn(batch, width, device=run.device)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log(loss=loss)
    return {"loss": loss.item()}
