"""A torchrun-style script for the sweeper's tests of script trials (tests/conf/task/tune_script.yaml): how it
trains depends on its trial's number, read from the trial's file (EXPGPU_TRIAL reaches the script too), as
tests/helpers/tune_probe.py's does. Every step all-reduces over gloo (as DDP would: a rank whose peer died
fails in its next collective), sleeps --step-s and logs `score` with expgpu.log on rank 0: 1.0 for an odd
trial, 0.0 for an even one. An odd trial, the one the tests prune, runs --losing-steps rather than --steps: long
enough that a prune reaching it late on a loaded machine still finds it running, so "stopped before its end" is
what the test sees rather than a race. No SIGTERM handler: a stopped script dies of it, as most do.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import expgpu

p = argparse.ArgumentParser()
p.add_argument("--x", type=float, default=0.0)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--losing-steps", type=int, default=400)
p.add_argument("--step-s", type=float, default=0.05)
args = p.parse_args()

number = json.load(open(os.environ["EXPGPU_TRIAL"]))["number"] if os.environ.get("EXPGPU_TRIAL") else 0
distributed = "WORLD_SIZE" in os.environ
if distributed:
    dist.init_process_group("gloo")
score = float(number % 2)
steps = args.losing_steps if score else args.steps
for step in range(1, steps + 1):
    t = torch.ones(1)
    if distributed:
        dist.all_reduce(t)
    time.sleep(args.step_s)
    expgpu.log(score=score, step=step, max_steps=steps)
if distributed:
    dist.destroy_process_group()
    time.sleep(0.05)   # torch 2.13's gloo teardown race: see examples/scripts/ddp_train.py
