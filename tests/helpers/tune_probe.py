"""A task for the sweeper's tests (`--config-dir tests/conf task=tune_probe`, tests/ on PYTHONPATH): how it
trains depends on its trial's number, read from the trial's file, so a test knows which trial does what
whatever the sampler proposes.

Each step sleeps `step_s` (trial 0: `slow_step_s`) and logs `score` every step: 1.0 for an odd trial,
0.0 for an even one; returns the last score and `x`, the searched parameter.
"""

from __future__ import annotations

import json
import os
import time

import torch


def train(run, x: float = 0.0, max_steps: int = 20, step_s: float = 0.02, slow_step_s: float = 0.02):
    number = json.load(open(os.environ["EXPGPU_TRIAL"]))["number"] if os.environ.get("EXPGPU_TRIAL") else 0
    model = run.wrap(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(model=model, opt=opt)
    score = float(number % 2)
    for step, _ in run.steps(None, max_steps):
        loss = model(torch.ones(4, 2)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(slow_step_s if number == 0 else step_s)
        run.log(score=score)
    return {"score": score, "x": x}
