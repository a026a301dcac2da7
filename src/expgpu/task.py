"""A task built from config: model, datasets, optimizer factory and loss from `_target_`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from expgpu.errors import UserError

# Keys that change what is trained: a checkpoint is only resumed under the same values
# (max_steps may grow, log_every and name don't matter).
IDENTITY_KEYS = ("model", "dataset", "optimizer", "loss", "batch_size", "seed")


@dataclass
class Task:
    name: str
    model: Any                    # nn.Module, on the CPU until placed
    dataset: Any
    eval_dataset: Any | None
    make_optimizer: Callable      # params -> torch.optim.Optimizer
    loss_fn: Callable
    classification: bool          # accuracy is reported for these
    batch_size: int
    max_steps: int
    seed: int
    log_every: int
    fingerprint: str


def fingerprint(task_cfg: dict) -> str:
    ident = {k: task_cfg.get(k) for k in IDENTITY_KEYS}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _instantiate(node: Any, key: str):
    from hydra.utils import instantiate

    try:
        return instantiate(node)
    except Exception as e:
        # A typo in a user's _target_ is bad input, not a crash: name the key and the target.
        cause = e.__cause__ or e
        raise UserError(f"task.{key}: cannot build {node.get('_target_')!r}: "
                        f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}") from None


def build(task_cfg: dict) -> Task:
    import torch

    torch.manual_seed(task_cfg["seed"])  # the same initial weights on every rank
    model = _instantiate(task_cfg["model"], "model")
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"task.model: {task_cfg['model'].get('_target_')!r} built a "
                        f"{type(model).__name__}, not a torch.nn.Module")
    dataset = _instantiate(task_cfg["dataset"], "dataset")
    eval_cfg = task_cfg.get("eval_dataset")
    eval_dataset = _instantiate(eval_cfg, "eval_dataset") if eval_cfg else None
    make_optimizer = _instantiate(task_cfg["optimizer"], "optimizer")
    if not callable(make_optimizer):
        raise UserError("task.optimizer: needs `_partial_: true` so expgpu can pass the parameters")
    loss = task_cfg["loss"]
    if loss == "mse":
        loss_fn, classification = torch.nn.MSELoss(), False
    elif loss == "cross_entropy":
        loss_fn, classification = torch.nn.CrossEntropyLoss(), True
    else:
        loss_fn = _instantiate(loss, "loss")
        classification = isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))
    return Task(
        name=task_cfg["name"], model=model, dataset=dataset, eval_dataset=eval_dataset,
        make_optimizer=make_optimizer, loss_fn=loss_fn, classification=classification,
        batch_size=task_cfg["batch_size"], max_steps=task_cfg["max_steps"], seed=task_cfg["seed"],
        log_every=task_cfg["log_every"], fingerprint=fingerprint(task_cfg),
    )
