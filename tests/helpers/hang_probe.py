"""A 2-rank training loop in which one rank stops making progress at one step, the way real runs hang
(`--config-dir tests/conf task=probe_hangs`): the watchdog must name this file's line.

    how=sleep       rank `rank` sleeps (its data loader stuck, a dead file system)
    how=spin        a tight pure-Python loop that holds the GIL between switches
    how=collective  a collective the other ranks never call
    how=slow        no hang: step `at` takes `slow_s` (a slow step, not stuck)
    how=phase       no hang: a long stretch inside run.phase("evaluation") at step `at`
    how=save        no hang: every checkpoint save (checkpoint.every_steps) takes `slow_s` on rank `rank`
    how=setup       no hang: before run.steps, rank `rank` takes `slow_s` (a download) while the others wait
                    in run.barrier()
    how=late        rank `rank` takes `slow_s` before run.steps, with no collective there: the others' first step
                    waits for it
    how=after       no hang: after run.steps, every rank's own code takes `slow_s` (an evaluation, no run.phase)
    how=crash       rank `rank` raises at step `at`, with a thread of its own that keeps its process
                    alive `slow_s` more (the interpreter waits for it at exit)
    how=stop        an early stop decided on rank `rank` alone at step `at`: `break` (stop=break), `return`
                    (stop=return), sys.exit(0) (stop=exit) or os._exit(0) (stop=os_exit); the others go on
    how=uneven      one epoch (run.epochs(1)) of data sharded by hand, unevenly: rank `rank`'s holds `at` batches,
                    the others' max_steps
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from expgpu import Run


class SlowState:
    """Tracked state whose state_dict() takes `seconds` on one rank (a big model saved to a slow disk)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def state_dict(self) -> dict:
        time.sleep(self.seconds)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def hangs(run: Run, rank: int = 1, at: int = 5, how: str = "sleep", max_steps: int = 20, slow_s: float = 0.0,
          step_s: float = 0.0, stop: str = "break"):
    torch.manual_seed(0)
    net = run.wrap(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    run.track(net=net, opt=opt, **({"slow": SlowState(slow_s if run.rank == rank else 0)} if how == "save" else {}))
    x = torch.randn(16, 8)
    if how in ("setup", "late"):
        if run.rank == rank:
            time.sleep(slow_s)
        if how == "setup":
            run.barrier()
    if how == "uneven":
        for _ in run.epochs(1):
            for _, batch in run.steps([x] * (at if run.rank == rank else max_steps)):
                net(batch).pow(2).mean().backward()
        return {}
    for step, _ in run.steps(None, max_steps):
        if step == at and run.rank == rank:
            if how == "sleep":
                time.sleep(3600)
            elif how == "spin":
                n = 0
                while True:
                    n += 1
            elif how == "collective":
                torch.distributed.barrier()
            elif how == "slow":
                time.sleep(slow_s)
            elif how == "crash":
                threading.Thread(target=time.sleep, args=(slow_s,), name="prefetcher").start()
                raise RuntimeError(f"rank {run.rank} crashed at step {step}")
            elif how == "stop" and stop == "break":
                break
            elif how == "stop" and stop == "return":
                return {"loss": 0.0}
            elif how == "stop" and stop == "exit":
                sys.exit(0)
            elif how == "stop" and stop == "os_exit":
                os._exit(0)
        if step == at and (how == "phase" or how == "alone" and run.rank == rank):   # alone: that rank's own
            with run.phase("evaluation"):
                time.sleep(slow_s)
        if step_s:
            time.sleep(step_s)
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log(loss=loss)
    if how == "after":
        time.sleep(slow_s)
    return {"loss": loss.item()}
