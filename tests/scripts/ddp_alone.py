"""A torchrun-style DDP script whose rank 1 works alone (an evaluation, a save) for --alone-s at step 5, past its
process group's --timeout-s: rank 0's next all-reduce times out waiting for it (tests/script/test_script_run.py)."""

import argparse
import datetime
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--alone-s", type=float, default=12.0)
p.add_argument("--timeout-s", type=float, default=3.0)
args = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    if step == 5 and dist.get_rank() == 1:
        time.sleep(args.alone_s)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
