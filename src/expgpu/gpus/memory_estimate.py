"""The memory each rank will hold for parameters and optimizer state, under ddp and under fsdp:
the dry run's line (local launcher, plain sbatch, hydra/launcher=slurm).

ddp keeps the whole model and the whole optimizer state on every rank; fsdp (FSDP2's fully_shard)
keeps 1/world of each. Gradients, activations and the allocator's slack are not counted: this is
the part of the memory that sharding divides, not a prediction of the peak.

The parameters are counted by building the built-in task's `task.model` on the meta device (no
memory, no CUDA) in a child process, so that the dry run itself never imports torch. Optimizer
state per parameter: Adam / AdamW keep two fp32 tensors per parameter (three with amsgrad), SGD
with momentum one, SGD without none; any other optimizer is "unknown", as is the model of a task
function or a script, which build their own: no guess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

# fp32 state tensors per parameter, by optimizer class name
_STATES = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "RMSprop": 1}
FP32 = 4
TIMEOUT_S = 120   # building a model on the meta device takes a second; the import of torch the rest


@dataclass
class Estimate:
    """What one rank holds for the whole model (ddp); None where it is unknown, with `why`."""
    param_bytes: int | None = None
    params: int | None = None           # how many parameters (elements)
    model: str = ""
    opt_bytes: int | None = None
    optimizer: str = ""
    why: str = ""                       # why the parameters or the optimizer state are unknown

    def per_rank(self, world: int, wrap: str) -> tuple[int | None, int | None]:
        """(parameter bytes, optimizer state bytes) on one of `world` ranks under `wrap`."""
        def share(n: int | None) -> int | None:
            return None if n is None else (-(-n // world) if wrap == "fsdp" else n)
        return share(self.param_bytes), share(self.opt_bytes)


def optimizer_states(optimizer: Any) -> tuple[float | None, str]:
    """(fp32 state tensors per parameter, the optimizer's name) from task.optimizer's config."""
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("_target_"), str):
        return None, "an optimizer of unknown kind"
    name = optimizer["_target_"].rsplit(".", 1)[-1]
    if name == "SGD":
        return (1 if float(optimizer.get("momentum") or 0) > 0 else 0), name
    if name in ("Adam", "AdamW") and optimizer.get("amsgrad"):
        return 3, name
    return _STATES.get(name), name


def count(task: dict) -> Estimate:
    """In this process (imports torch): the built-in task's model built on the meta device."""
    import torch
    from hydra.utils import instantiate

    states, opt_name = optimizer_states(task.get("optimizer"))
    try:
        with torch.device("meta"):
            model = instantiate(task["model"])
    except Exception as e:   # a model that computes in __init__ (meta tensors hold no values)
        return Estimate(why=f"task.model cannot be built on the meta device ({type(e).__name__})",
                        optimizer=opt_name)
    params = [p for p in model.parameters()]
    numel = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    est = Estimate(param_bytes=sum(p.numel() * p.element_size() for p in params), params=numel,
                   model=type(model).__name__, optimizer=opt_name)
    if states is None:
        est.why = f"the state of {opt_name} is not known here"
    else:
        est.opt_bytes = int(states * trained * FP32)
    return est


def measure(task: dict) -> Estimate:
    """The estimate for `task` (the resolved task config); built in a child process."""
    return measure_many([task])[0]


def measure_many(tasks: list[dict]) -> list[Estimate]:
    """Estimates for a sweep's tasks: every distinct model and optimizer counted once, all in one
    child process (it imports torch: seconds, not seconds per job)."""
    out: list[Estimate | None] = [_unknowable(t) for t in tasks]
    keys = {json.dumps([t.get("model"), t.get("optimizer")], sort_keys=True, default=str): t
            for t, est in zip(tasks, out) if est is None}
    counted = dict(zip(keys, _count_in_child(list(keys.values())))) if keys else {}
    return [est or counted[json.dumps([t.get("model"), t.get("optimizer")], sort_keys=True, default=str)]
            for t, est in zip(tasks, out)]


def _unknowable(task: dict) -> Estimate | None:
    """Why `task`'s model cannot be counted, or None when it can."""
    if "_target_" in task:
        return Estimate(why="a task function builds its own model")
    if task.get("script") or task.get("module"):
        return Estimate(why="a script task builds its own model")
    if not isinstance(task.get("model"), dict):
        return Estimate(why="task.model is not a config with _target_")
    return None


def _count_in_child(tasks: list[dict]) -> list[Estimate]:
    try:
        proc = subprocess.run([sys.executable, "-m", "expgpu.gpus.memory_estimate"], input=json.dumps(tasks),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [Estimate(why=f"counting the parameters took over {TIMEOUT_S} s")] * len(tasks)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [Estimate(why=f"counting the parameters failed: {tail}")] * len(tasks)
    return [Estimate(**d) for d in json.loads(proc.stdout.strip().splitlines()[-1])]


def human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def line(est: Estimate, world: int) -> str:
    """One line: each rank's parameters + optimizer state under ddp and fsdp at `world` ranks."""
    def one(wrap: str) -> str:
        p, o = est.per_rank(world, wrap)
        total = human(p + o) if p is not None and o is not None else "unknown"
        return f"{wrap} {total} ({human(p)} + {human(o)})"

    head = f"memory per rank for parameters + optimizer state, {world} rank(s): "
    if est.param_bytes is None:
        return head + f"unknown ({est.why})"
    what = f"{est.model}: {est.params:,} parameters, {est.optimizer}"
    return head + f"{one('ddp')}, {one('fsdp')}; {what}" + (f" ({est.why})" if est.why else "")


def main() -> None:   # the child: task configs on stdin, their estimates as JSON on stdout
    tasks = json.loads(sys.stdin.read())
    print(json.dumps([count(task).__dict__ for task in tasks]))


if __name__ == "__main__":
    main()
