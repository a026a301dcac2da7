"""A torchrun-style script for the sweeper's tests of script trials (tests/conf/task/tune_script.yaml): how it
trains depends on its trial's number, read from the trial's file (EXPGPU_TRIAL reaches the script too), as
tests/helpers/tune_probe.py's does. Every step all-reduces over gloo (as DDP would: a rank whose peer died
fails in its next collective), sleeps --step-s and logs `score` with expgpu.log on rank 0: 1.0 for an odd
trial, 0.0 for an even one. No SIGTERM handler: a stopped script dies of it, as most do.
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
p.add_argument("--step-s", type=float, default=0.05)
args = p.parse_args()

number = json.load(open(os.environ["EXPGPU_TRIAL"]))["number"] if os.environ.get("EXPGPU_TRIAL") else 0
distributed = "WORLD_SIZE" in os.environ
if distributed:
    dist.init_process_group("gloo")
score = float(number % 2)
for step in range(1, args.steps + 1):
    t = torch.ones(1)
    if distributed:
        dist.all_reduce(t)
    time.sleep(args.step_s)
    expgpu.log(score=score, step=step, max_steps=args.steps)
if distributed:
    dist.destroy_process_group()
    time.sleep(0.05)   # torch 2.13's gloo teardown race: see examples/scripts/ddp_train.py
