"""The built-in training function: model + dataset + optimizer + loss, written on the Run API.

A task file without `_target_` is this function's parameters (conf/task/a.yaml, b.yaml, digits.yaml):

    model: {_target_: ...}           an nn.Module
    dataset: {_target_: ...}         a map-style Dataset of (input, target)
    optimizer: {_target_: torch.optim.X, _partial_: true, lr: ...}
    loss: mse | cross_entropy | {_target_: ...}   (a callable (output, target) -> loss)
    batch_size, max_steps            per rank; a step is one optimizer step on every rank
    eval_dataset, eval_every         held-out split; every rank evaluates its share (all-reduced)
    eval_batch_size                  per rank, for the evaluation (null: batch_size)
    precision (32 | bf16 | 16), scheduler, accumulate, clip_grad_norm, compile

Nothing on the hot path that a plain PyTorch DDP loop would not do: the loss is read back only
every log_every steps (run.log), evaluation only every eval_every steps.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional

from expgpu import config
from expgpu.distributed.wrap import no_sync, skips_sync
from expgpu.errors import UserError, first_line, shown
from expgpu.train import proportional
from expgpu.train.batches import SeededFetch
from expgpu.train.run import Run


def train(run: Run, model: Any, dataset: Any, optimizer: Any, batch_size: int, max_steps: int,
          loss: Any = "mse", eval_dataset: Any = None, scheduler: Any = None, accumulate: int = 1,
          clip_grad_norm: Optional[float] = None, eval_every: int = 0, compile: bool = False,
          eval_batch_size: Optional[int] = None) -> dict:
    import torch

    _check(batch_size, max_steps, accumulate, clip_grad_norm, eval_every, eval_batch_size)
    config.check_world(run.cfg, run.world_size)   # checked before the ranks start too, where the world is known
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"task.model: built a {type(model).__name__}, not a torch.nn.Module")
    loss_fn, classification = _loss(loss)
    net = run.wrap(model)
    if compile:
        net = torch.compile(net)
    opt = _build(optimizer, "optimizer", net.parameters())
    sched = _build(scheduler, "scheduler", opt) if scheduler is not None else None
    scaler = torch.amp.GradScaler(run.device.type) if run.precision == "16" else None
    given, batch_size = batch_size, run.rank_batch(batch_size, "task.batch_size")   # per rank on this world
    local, sampler, loader = _data(run, dataset, given, batch_size, loss_fn, hasattr(net, "no_sync"), accumulate)
    split = proportional.SplitState(local.split.mode if local else "uniform", local, sampler, batch_size,
                                    run.world_size)
    run.track(model=model, optimizer=opt, shard=split,
              **({"scheduler": sched} if sched is not None else {}),
              **({"scaler": scaler} if scaler is not None else {}))
    ws = run.world_size
    share = f" (its share of {given} x {run.start_world_size} at the start)" if given != batch_size else ""
    run.result_extra["step_means"] = ("one optimizer step of every rank: a global batch of task.batch_size "
                                      f"{batch_size}{share}"
                                      f"{f' x accumulate {accumulate}' if accumulate > 1 else ''} x {ws} rank(s) = "
                                      f"{batch_size * accumulate * ws} examples")
    held_out = eval_dataset if eval_dataset is not None else (dataset if classification else None)
    # no gradients kept: a larger batch than training's fits, and evaluates in fewer, fuller passes
    evaluator = _Evaluator(run, model, held_out, loss_fn, classification, eval_batch_size or given,
                           prefix="eval_" if eval_dataset is not None else "train_", repeated=eval_every > 0)
    last, results = None, {}
    try:
        for step, batch in run.steps(loader, max_steps, accumulate=accumulate):
            opt.zero_grad(set_to_none=True)
            last = _forward_backward(run, net, loss_fn, batch if accumulate > 1 else (batch,), local, scaler)
            if scaler is not None:
                scaler.unscale_(opt)   # clip the true gradients, not the scaled ones
            if clip_grad_norm is not None:
                run.log(grad_norm=torch.nn.utils.clip_grad_norm_(net.parameters(), clip_grad_norm))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            run.log(loss=last, lr=opt.param_groups[0]["lr"])
            if sched is not None:
                _step(sched, step, max_steps)
            if local is not None and local.rebalance_due():
                sampler.sizes = local.rebalance(lambda obj: _gather(obj, run.world_size)).sizes
                run.restart_epoch()   # the next global batch is sliced by the new split
            if evaluator.ready and ((eval_every and (step + 1) % eval_every == 0) or step + 1 == max_steps):
                results = evaluator()
                run.log(**results)
    finally:
        run.result_extra["shard"] = split.state_dict()   # result.json: the split the run ended with
    return {"final_loss": _global_loss(run, last, local), **results}


def _check(batch_size, max_steps, accumulate, clip, eval_every, eval_batch_size) -> None:
    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        if not ok:
            raise UserError(f"task.{key}={shown(value)} is not allowed: {allowed}")

    need(batch_size >= 1, "batch_size", batch_size, "an integer >= 1")
    need(max_steps >= 1, "max_steps", max_steps, "an integer >= 1")
    need(accumulate >= 1, "accumulate", accumulate, "an integer >= 1 (micro-batches per optimizer step)")
    need(clip is None or clip > 0, "clip_grad_norm", clip, "null or a max norm > 0")
    need(eval_every >= 0, "eval_every", eval_every, "0 (only at the end) or a step count")
    need(eval_batch_size is None or eval_batch_size >= 1, "eval_batch_size", eval_batch_size,
         "null (task.batch_size) or an integer >= 1")


def _loss(loss: Any) -> tuple[Any, bool]:
    import torch

    if loss == "mse":
        return torch.nn.MSELoss(), False
    if loss == "cross_entropy":
        return torch.nn.CrossEntropyLoss(), True
    if isinstance(loss, str) or not callable(loss):
        raise UserError(f"task.loss={loss!r} is not allowed: mse, cross_entropy or {{_target_: ...}} "
                        "(a callable (output, target) -> loss)")
    return loss, isinstance(loss, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))


def _build(factory: Any, key: str, arg: Any) -> Any:
    """optimizer(params) / scheduler(optimizer) from a `_partial_: true` config. What its constructor
    refuses is one line, as a model or dataset that cannot be built (expgpu.task.build_params): a value it
    checks (torch's optimizers raise ValueError, e.g. task.optimizer.lr=-1), or a keyword that one taking
    **kwargs does not take, with the ones it names (build_params refused the others' already)."""
    if not callable(factory):
        raise UserError(f"task.{key}: needs `_partial_: true` so that expgpu can pass the "
                        f"{'parameters' if key == 'optimizer' else 'optimizer'}")
    try:
        return factory(arg)
    except UserError:
        raise
    except Exception as e:
        func = getattr(factory, "func", None)
        why, takes = f"{type(e).__name__}: {first_line(e)}", ""
        if isinstance(e, TypeError):   # a keyword it does not take: Python's own message names it
            why = first_line(e)
            try:
                names = [p for p in inspect.signature(func).parameters if p not in ("self", "params", "optimizer")]
                takes = f"; it takes {', '.join(names)}"
            except (TypeError, ValueError):
                pass
        raise UserError(f"task.{key}: {getattr(func, '__name__', key)} refused its settings ({why}){takes}") from None


def _step(sched, step: int, max_steps: int) -> None:
    """The scheduler's step; what it raises is its settings' fault (OneCycleLR's total_steps below
    task.max_steps, StepLR's step_size=0, a scheduler that needs a metric): one line, at the step it failed."""
    try:
        sched.step()
    except Exception as e:
        raise UserError(f"task.scheduler: {type(sched).__name__} failed at step {step + 1} ({type(e).__name__}: "
                        f"{first_line(e)}); the built-in loop steps it once a step, with no argument, for "
                        f"task.max_steps={max_steps} steps") from None


def _data(run: Run, dataset, given: int, batch_size: int, loss_fn, ddp: bool, accumulate: int):
    """(the data.shard LocalStep or None, its batch sampler or None, the loader run.steps walks);
    `given` is task.batch_size, `batch_size` this rank's share of the global batch now."""
    from torch.utils.data import DataLoader

    ws, n = run.world_size, len(dataset)
    local = proportional.prepare(run.cfg, ws, run.rank, batch_size, loss_fn, run.device, run.gpu_speed,
                          ddp=ddp, gather=lambda obj: _gather(obj, ws), accumulate=accumulate)
    if local is None or local.split.mode == "uniform":
        share = n // ws
        if share < batch_size:
            raise UserError(f"task.batch_size={batch_size} is larger than a rank's share of the dataset "
                            f"({n} examples / {ws} ranks = {share}); lower it")
        # run.loader takes its share as _rank_batch did
        return local, None, run.loader(dataset, given, **_kept_workers(run))
    if n < batch_size * ws:
        raise UserError(f"task.batch_size={batch_size} x {ws} ranks = a global batch of {batch_size * ws}, more "
                        f"than the dataset's {n} examples; lower it")
    seed, workers = run.cfg.task.get("seed", 0), run.cfg.data.num_workers
    sampler = proportional.ShareBatchSampler(n, local.split.sizes, run.rank, seed)
    if workers:   # as run.loader does: the workers' random draws seeded per batch
        dataset, sampler.keyed = SeededFetch(dataset, seed), True
    loader = DataLoader(dataset, batch_sampler=sampler, pin_memory=run.device.type == "cuda", num_workers=workers,
                        **_kept_workers(run))
    return local, sampler, loader


def _kept_workers(run: Run) -> dict:
    """A built-in loader walked more than once keeps its workers as long as it lives (persistent_workers):
    started again for each epoch or evaluation, they would cost each one their start (a fork, the
    dataset's copy, its first batches) while the step waits. The loop's datasets are not changed between
    epochs, the one reason to start them again. run.loader's own default stays PyTorch's (False): a
    script's dataset may be."""
    return {"persistent_workers": True} if run.cfg.data.num_workers else {}


def _forward_backward(run: Run, net, loss_fn, batches, local, scaler):
    """One optimizer step's forward and backward; DDP syncs gradients only on the last micro-batch."""
    k = len(batches)
    for i, (x, y) in enumerate(batches):
        sync = i == k - 1 or not skips_sync(net)
        with contextlib.nullcontext() if sync else no_sync(net):
            with local.step(net, len(y)) if local is not None else contextlib.nullcontext(1.0) as weight:
                with run.autocast():
                    loss = loss_fn(net(x), y)
                scaled = loss * (weight / k) if weight != 1.0 or k > 1 else loss
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
    return loss


def _global_loss(run: Run, loss, local) -> float | None:
    """The last step's loss over the whole global batch, however it was split (all ranks)."""
    if loss is None:
        return None
    from expgpu.distributed.group import all_reduce_sum

    mine = float(loss.detach()) * (local.weight if local is not None else 1.0)
    return all_reduce_sum([mine], run.device)[0] / run.world_size


def _gather(obj, world_size: int) -> list:
    from expgpu.distributed.group import gather_objects

    return gather_objects(obj, world_size)


class _Evaluator:
    """Every rank evaluates its share of a held-out set; the sums are all-reduced."""

    def __init__(self, run: Run, model, dataset, loss_fn, classification: bool, batch_size: int, prefix: str,
                 repeated: bool):
        self.run, self.model, self.loss_fn, self.classification = run, model, loss_fn, classification
        self.prefix = prefix
        self.ready = dataset is not None
        if self.ready:
            self.loader = run.loader(dataset, batch_size, shuffle=False, drop_last=False,
                                     **(_kept_workers(run) if repeated else {}))
            self.summed = proportional.loss_reduction(loss_fn) == "sum"

    def __call__(self) -> dict[str, float]:
        import torch

        from expgpu.distributed.group import all_reduce_sum
        from expgpu.train.batches import to_device

        model, was_training = self.model, self.model.training
        model.eval()   # the unwrapped module: DDP's forward would sync buffers, and ranks' batch counts differ
        loss_sum = torch.zeros((), device=self.run.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.run.device, dtype=torch.int64)
        count = 0
        with torch.no_grad(), self.run.autocast():
            for x, y in self.loader:
                x, y = to_device(x, self.run.device), to_device(y, self.run.device)
                out = model(x)
                batch_loss = self.loss_fn(out, y).double()
                loss_sum += batch_loss if self.summed else batch_loss * len(y)
                if self.classification:
                    correct += (out.argmax(dim=1) == y).sum()
                count += len(y)
        model.train(was_training)
        total, right, n = all_reduce_sum([float(loss_sum), float(correct), count], self.run.device)
        results = {f"{self.prefix}loss": total / max(n, 1)}
        if self.classification:
            results["accuracy" if self.prefix == "eval_" else f"{self.prefix}accuracy"] = right / max(n, 1)
        return results
