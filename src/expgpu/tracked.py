"""What a run's checkpoint holds, and putting it back: the checkpoint half of `Run`.

checkpoint.pt (in the run dir) holds the objects given to `run.track` (their state_dict(), from
rank 0: DDP keeps the ranks' copies equal), the step, and for every rank its RNG states and its
position in the data; rank 0's metrics rows not yet written out ride along. `Tracked` makes that
state (a collective `save`, every rank at the same step) and restores it (`resume`, before the
first step). checkpoint.py is the file underneath: atomic, tensors-only loading, shape checks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from expgpu import checkpoint, dist, rng, rundir
from expgpu.errors import UserError, first_line

log = logging.getLogger("expgpu")


class Tracked:
    """The objects a run tracks, and the checkpoint that carries them across a stop."""

    def __init__(self, run_dir: Path, spec, rank: int, world_size: int, device):
        self.path = Path(run_dir) / rundir.CHECKPOINT
        self.objects: dict[str, Any] = {}
        self._spec, self._rank, self._world_size, self._device = spec, rank, world_size, device

    def add(self, name: str, obj: Any) -> None:
        if isinstance(obj, dict):
            obj = _DictState(obj)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(f"run.track({name}=...): a {type(obj).__name__} has no state_dict() and "
                            "load_state_dict(); track modules, optimizers, schedulers, a GradScaler, "
                            "a dict of numbers, or objects of your own that have both")
        self.objects[name] = unwrapped(obj)

    def expect(self) -> dict:
        """The run shape a checkpoint must match to be resumed here."""
        return {"task": self._spec.name, "world_size": self._world_size, "fingerprint": self._spec.fingerprint}

    def check_loadable(self) -> None:
        """Objects of the user's own whose state a resume could not load: one line before training.
        Modules, optimizers, schedulers and scalers save tensors and numbers: not copied to check."""
        import torch

        own = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)
        for name, obj in self.objects.items():
            if not isinstance(obj, own):
                checkpoint.check_loadable(name, obj.state_dict())

    def resume(self, feed, metrics) -> int | None:
        """Put the checkpoint's state back (tracked objects, data position, RNG, rank 0's rows);
        the step it was saved at, or None when there is nothing to resume."""
        path = self.path
        state = checkpoint.load(path, self.expect(), self._spec.identity)
        saved, mine = sorted(state["tracked"]), sorted(self.objects)
        if saved != mine:
            raise UserError(f"checkpoint {path} tracks {', '.join(saved) or 'nothing'}, this run tracks "
                            f"{', '.join(mine) or 'nothing'} (run.track); resume with the same code or use a new run dir")
        for name, obj in self.objects.items():
            try:
                obj.load_state_dict(state["tracked"][name])
            except UserError:
                raise
            except Exception as e:  # same settings, other code
                raise UserError(f"checkpoint {path}: {name} does not fit what this run tracks as {name} "
                                f"({type(e).__name__}: {first_line(e)}); use a new run dir") from None
        mine_state = state["ranks"][self._rank]
        feed.resume(mine_state["epoch"], mine_state["position"])
        rng.restore(mine_state["rng"], self._device)
        if metrics is not None:
            metrics.load_state_dict(state.get("metrics", []))
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, state["step"], feed.epoch, feed.position)
        return state["step"]

    def save(self, step: int, feed, metrics, reason: str) -> None:
        """Collective: every rank calls it at the same step; rank 0 (the one with `metrics`) writes."""
        mine = {"rng": rng.capture(self._device), "epoch": feed.epoch, "position": feed.position}
        ranks = dist.gather_objects(mine, self._world_size)
        if metrics is None:
            return
        metrics.write_out()   # the rows up to this step are on disk before the checkpoint is
        checkpoint.save(self.path, {
            **self.expect(), "params": json.dumps(self._spec.identity, sort_keys=True, default=str),
            "step": step, "ranks": ranks,
            "tracked": {name: obj.state_dict() for name, obj in self.objects.items()},
            "metrics": metrics.state_dict(),
        })
        log.info("checkpoint at step %d (%s): %s", step, reason, self.path)

    def checksum(self) -> str | None:
        """Of every tracked module's state: equal on all ranks when DDP kept them in step."""
        modules = {n: o for n, o in sorted(self.objects.items()) if hasattr(o, "named_parameters")}
        if not modules:
            return None
        import torch

        h = hashlib.sha256()
        for name, module in modules.items():
            for key, tensor in module.state_dict().items():
                h.update(f"{name}.{key}".encode())
                raw = tensor.detach().to("cpu").contiguous().view(-1)
                h.update(raw.view(torch.uint8).numpy().tobytes())   # any dtype, bf16 too
        return h.hexdigest()[:16]


class _DictState:
    """A plain dict tracked in place (the best metric so far, counters): its items are saved, and
    a resume puts the saved ones back into the same dict object the loop holds."""

    def __init__(self, d: dict):
        self.d = d

    def state_dict(self) -> dict:
        # NumPy scalars (np.mean's result) as Python numbers: torch.load(weights_only=True) reads those
        return {k: v.item() if type(v).__module__ == "numpy" and getattr(v, "ndim", 1) == 0 else v
                for k, v in self.d.items()}

    def load_state_dict(self, state: dict) -> None:
        self.d.clear()
        self.d.update(state)


def unwrapped(obj: Any) -> Any:
    """The module inside DDP / DataParallel / torch.compile: its state_dict has no wrapper prefix."""
    for _ in range(3):
        inner = getattr(obj, "_orig_mod", None) or (getattr(obj, "module", None)
                                                    if type(obj).__name__ in ("DistributedDataParallel",
                                                                               "DataParallel") else None)
        if inner is None:
            return obj
        obj = inner
    return obj
