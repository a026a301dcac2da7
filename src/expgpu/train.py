"""The training loop: explicit, top to bottom, the same for 1 rank and for many.

Nothing on the hot path that a plain PyTorch DDP loop would not do: the loss is read
back (`.item()`) only every `log_every` steps, the stop flag is all-reduced only every
`poll_every` steps, and timing syncs the GPU twice in all.

Data order is a pure function of (seed, epoch), which is what DistributedSampler
gives; a checkpoint stores (step, epoch, position in epoch), so a resumed run sees
exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from expgpu import checkpoint, shard
from expgpu.errors import UserError
from expgpu.ranks import RankInfo
from expgpu.stopping import Stopper
from expgpu.task import Task

log = logging.getLogger("expgpu")


@dataclass
class Outcome:
    status: str                   # finished | stopped
    step: int
    resumed_from_step: int | None
    final_loss: float | None
    accuracy: float | None
    startup_s: float
    first_step_at: float          # unix time: the benchmark compares launch-to-first-step
    train_s: float
    steps_per_s: float | None
    param_checksum: str
    stop_signal: str | None = None
    extra: dict = field(default_factory=dict)


class _Positions:
    """The sampler's indices of one epoch, from a batch position on (exact resume)."""

    def __init__(self, indices: list[int], start: int):
        self.indices = indices[start:]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def param_checksum(model) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _trim_metrics(path: Path, step: int) -> None:
    """Drop the rows a run is about to redo (logged after the checkpoint it resumes, before a
    crash; all of them when it starts over), so metrics.jsonl reads like one uninterrupted run."""
    if not path.exists():
        return

    def before(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):  # a line torn by a kill mid-write
            return False

    lines = path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if before(line)]
    if len(keep) != len(lines):
        checkpoint.atomic_write_bytes(path, "".join(keep).encode())


def _gather(obj: Any, world_size: int) -> list:
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _rng_state(device) -> dict:
    import torch

    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device) -> None:
    import torch

    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


class _Progress:
    """A live bar on rank 0 when stderr is a terminal; plain log lines otherwise."""

    def __init__(self, enabled: bool, total: int, start: int):
        self.bar, self.enabled = None, enabled
        if enabled and sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=False)
            self.bar.start()
            self.task = self.bar.add_task("training", total=total, completed=start)

    def update(self, step: int, loss: float | None) -> None:
        if self.bar is not None:
            desc = f"training  loss {loss:.4f}" if loss is not None else "training"
            self.bar.update(self.task, completed=step, description=desc)
        elif self.enabled and loss is not None:
            log.info("step %d  loss %.5f", step, loss)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def evaluate_accuracy(model, dataset, device, batch: int = 1024) -> float:
    import torch
    from torch.utils.data import DataLoader

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch):
            pred = model(x.to(device)).argmax(dim=1).cpu()
            correct += int((pred == y).sum())
            total += len(y)
    model.train()
    return correct / max(total, 1)


def _inject_fault(faults: dict, rank: int, step: int) -> None:
    if faults.get("crash_rank") == rank and faults.get("crash_step") == step:
        if faults.get("kind") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected crash (faults.crash_rank={rank} faults.crash_step={step})")


def run(task: Task, model, raw_model, device, info: RankInfo, run_dir: Path, cfg: dict,
        stopper: Stopper, t_start: float, speed: float | None = None) -> Outcome:
    """Train `model` (possibly DDP-wrapped `raw_model`) to task.max_steps or a stop request.

    `speed`: this rank's GPU score from the node plan (None on a CPU rank), which
    data.shard=proportional sizes its batch by."""
    from torch.utils.data import DataLoader, DistributedSampler

    is_main = info.rank == 0
    ws = info.world_size
    optimizer = task.make_optimizer(model.parameters())
    ckpt_path = run_dir / checkpoint.FILENAME
    expect = {"task": task.name, "world_size": ws, "fingerprint": task.fingerprint}

    step = epoch = position = 0
    resumed_from = resumed_split = None
    if cfg["checkpoint"]["resume"] and ckpt_path.exists():
        state = checkpoint.load(ckpt_path, expect)
        try:
            raw_model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:  # same fingerprint, other code
            raise UserError(f"checkpoint {ckpt_path} does not fit this model or optimizer "
                            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); "
                            "use a new run dir") from None
        step, epoch, position = state["step"], state["epoch"], state["position"]
        _set_rng_state(state["rng"][info.rank], device)
        resumed_split = state.get("shard")
        resumed_from = step
        log.info("resumed from %s at step %d (epoch %d, batch %d)", ckpt_path, step, epoch, position)

    def save(reason: str) -> None:
        rng = _gather(_rng_state(device), ws)  # collective: every rank calls save()
        if is_main:
            checkpoint.save(ckpt_path, {
                **expect, "step": step, "epoch": epoch, "position": position, "rng": rng,
                "shard": local.split.to_dict() if local else {"mode": "uniform"},
                "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
            })
            log.info("checkpoint at step %d (%s): %s", step, reason, ckpt_path)

    # data.shard: None keeps the plain DDP step; otherwise this rank's share of every global batch
    # (same global batches as the uniform sampler's) and its loss weight (expgpu/shard.py).
    local = shard.prepare(cfg, ws, info.rank, task.batch_size, task.loss_fn, device, speed, resumed_split,
                          ddp=hasattr(model, "no_sync"), gather=lambda obj: _gather(obj, ws))
    sharded = local is not None and local.split.mode != "uniform"
    sampler = DistributedSampler(task.dataset, num_replicas=ws, rank=info.rank, shuffle=True,
                                 seed=task.seed, drop_last=False)
    bs = task.batch_size
    if sharded and len(task.dataset) < bs * ws:
        raise UserError(f"task.batch_size={bs} x {ws} ranks = a global batch of {bs * ws}, more than the "
                        f"dataset's {len(task.dataset)} examples; lower it")
    if not sharded and len(sampler) < bs:
        raise UserError(f"task.batch_size={bs} is larger than a rank's share of the dataset "
                        f"({len(task.dataset)} examples / {ws} ranks = {len(sampler)}); lower it")

    faults = cfg["faults"]
    every = cfg["checkpoint"]["every_steps"]
    if is_main:
        _trim_metrics(run_dir / "metrics.jsonl", step)
    metrics = open(run_dir / "metrics.jsonl", "a") if is_main else None
    progress = _Progress(is_main, task.max_steps, step)
    pin = device.type == "cuda"
    loss = None
    status, start_step = "finished", step
    if stopper.should_stop(step, force=True):  # a signal while starting up: save, no steps
        status = "stopped"
    t_first = time.time()
    t10 = None  # steps/s is measured after the first 10 steps (warm-up)
    try:
        while step < task.max_steps and status == "finished":
            if sharded:
                batches = shard.ShareBatchSampler(len(task.dataset), local.split.sizes, info.rank,
                                                  task.seed, epoch, position)
                loader = DataLoader(task.dataset, batch_sampler=batches, pin_memory=pin,
                                    num_workers=cfg["data"]["num_workers"])
            else:
                sampler.set_epoch(epoch)
                loader = DataLoader(task.dataset, batch_size=bs, drop_last=True, pin_memory=pin,
                                    sampler=_Positions(list(sampler), position * bs),
                                    num_workers=cfg["data"]["num_workers"])
            for x, y in loader:
                _inject_fault(faults, info.rank, step)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                if local is None:
                    loss = task.loss_fn(model(x), y)
                    loss.backward()
                else:
                    loss = local.forward_backward(model, task.loss_fn, x, y)
                optimizer.step()
                step += 1
                position += 1
                if step - start_step == 10:
                    _sync(device)
                    t10 = time.time()
                if step % task.log_every == 0 or step == task.max_steps:
                    value = loss.item()
                    progress.update(step, value)
                    if metrics:
                        metrics.write(json.dumps({"step": step, "loss": value, "epoch": epoch,
                                                  "time": round(time.time(), 3)}) + "\n")
                        metrics.flush()
                if every and step % every == 0 and step < task.max_steps:
                    save("every_steps")
                if step >= task.max_steps:  # done: a signal now changes nothing
                    break
                if stopper.should_stop(step):
                    status = "stopped"
                    break
                if local is not None and local.rebalance_due():
                    local.rebalance(lambda obj: _gather(obj, ws))
                    break  # a new loader takes the new split from this global batch on
            else:
                epoch, position = epoch + 1, 0
        stopper.settle()  # the stop poll still in flight: finished before the group goes
        _sync(device)
        t_end = time.time()
    finally:
        progress.close()
        if metrics:
            metrics.close()

    save("stop requested" if status == "stopped" else "end of training")
    final_loss = None
    if loss is not None:
        # weighted: the mean over the whole global batch, however it was split
        reduced = loss.detach().clone() * (local.weight if local else 1.0)
        if ws > 1:
            import torch.distributed as dist

            if dist.get_backend() == "nccl":
                reduced = reduced.to(device)
            dist.all_reduce(reduced)
            reduced /= ws
        final_loss = float(reduced)
    accuracy = None
    if status == "finished" and task.classification and is_main:
        accuracy = evaluate_accuracy(raw_model, task.eval_dataset or task.dataset, device)
    timed = step - start_step - 10
    return Outcome(
        status=status, step=step, resumed_from_step=resumed_from, final_loss=final_loss,
        accuracy=accuracy, startup_s=round(t_first - t_start, 3), first_step_at=t_first, train_s=round(t_end - t_first, 3),
        steps_per_s=round(timed / (t_end - t10), 2) if t10 and timed > 0 else None,
        param_checksum=param_checksum(raw_model), stop_signal=stopper.agreed if status == "stopped" else None,
        extra={"shard": local.split.to_dict() if local else {"mode": "uniform", "sizes": [bs] * ws}},
    )
