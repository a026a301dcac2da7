"""A model left in eval mode while it trains: `model.eval()` for an evaluation and no `model.train()` after it.

Its Dropout layers then drop nothing and its BatchNorm layers normalise with their running statistics (and stop
updating them) for the rest of the training: no error, a worse model. The watch looks at the tracked modules
whose layers behave otherwise in eval mode, at each step's end (one attribute read each): a module in eval mode
at the ends of two steps in a row (so when the second began and when it ended) whose parameters have gradients
trained a whole step in eval mode. An evaluation inside a step (eval, then train again) leaves it in train mode
at the step's end; one at a step's end, with `model.train()` at the next step's start, in train mode at that
step's end. Said once per module, on rank 0 (every rank runs the same code).
"""

from __future__ import annotations

from typing import Any

from expgpu.distributed.wrap import unwrapped


def modal_layers(module) -> list[str]:
    """The kinds of layer in `module` that behave otherwise in eval mode (Dropout, BatchNorm), by class name."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    kinds = {type(m).__name__ for m in module.modules() if isinstance(m, (_DropoutNd, _BatchNorm))}
    return sorted(kinds)


class ModeWatch:
    """The tracked modules with such layers; check() at each step's end."""

    def __init__(self, objects: dict[str, Any]):
        self.modules: list[tuple[str, Any, list[str]]] = []
        for name, obj in objects.items():
            module = unwrapped(obj)
            if hasattr(module, "modules") and hasattr(module, "training"):
                kinds = modal_layers(module)
                if kinds:
                    self.modules.append((name, module, kinds))
        self.since: dict[str, int] = {}   # module name -> the step at whose end it was first seen in eval mode

    def check(self, step: int) -> str | None:
        """At the end of step `step` (steps done): the warning for a module that trained a whole step in eval
        mode, once; None otherwise."""
        for name, module, kinds in self.modules:
            if module.training:
                self.since.pop(name, None)
                continue
            first = self.since.setdefault(name, step)
            if first < step and any(p.grad is not None for p in module.parameters()):
                self.modules = [m for m in self.modules if m[0] != name]
                return (f"{name} ({type(module).__name__}) trained step {step} in eval mode: {name}.eval() by the "
                        f"end of step {first} and no {name}.train() since, so its {', '.join(kinds)} layers work as "
                        f"in an evaluation (no dropout; BatchNorm's running statistics, not updated) while it trains: "
                        f"call {name}.train() after an evaluation (on purpose, BatchNorm frozen: {name}.train(), then "
                        f".eval() on those layers alone)")
        return None
