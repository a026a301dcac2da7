"""A torchrun-style DDP script whose rank 1 leaves early, with exit code 0, at step 10 (an early stop decided on one
rank): rank 0's next all-reduce then loses it (tests/script/test_script_run.py)."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1000):
    if step == 10 and dist.get_rank() == 1:
        sys.exit(0)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
