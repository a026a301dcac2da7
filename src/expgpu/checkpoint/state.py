"""What a run's checkpoint holds, and putting it back: the checkpoint half of `Run`.

checkpoint.pt (in the run dir) holds the objects given to `run.track` (their state_dict(), from
rank 0: DDP keeps the ranks' copies equal), the step, and for every rank its RNG states, its
position in the data and its own tracked dicts and kept loop variables (an RNN's carried hidden
state, a per-rank sum: each rank gets its own back); rank 0's metrics rows not yet written out ride
along. `CheckpointState` makes that
state (a collective `save`, every rank at the same step) and restores it (`resume`, before the
first step). checkpoint/file.py is the file underneath: atomic, tensors-only loading, shape checks.
With checkpoint.format=dcp (the default for launch.wrap=fsdp) the modules and optimizers go to
RUN_DIR/checkpoint/ instead, every rank writing its own shards (expgpu.checkpoint.sharded), and
the rest to that directory's expgpu.pt; a resume reads whichever of the two the run dir holds.
A checkpoint of another number of ranks resumes too, as expgpu.checkpoint.world_change says (DCP reshards
the modules and optimizers).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from expgpu import rundir
from expgpu.checkpoint import file as checkpoint
from expgpu.checkpoint import sharded, world_change
from expgpu.checkpoint.keep import KeptLocals
from expgpu.checkpoint.tensors import on_cpu, placed_like
from expgpu.distributed import group, rng
from expgpu.distributed.wrap import unwrapped
from expgpu.errors import UserError, first_line

log = logging.getLogger("expgpu")
# The tracked names of the loop variables run.steps / run.epochs keep (keep=), after this prefix.
KEPT = "keep:"


class CheckpointState:
    """The objects a run tracks, and the checkpoint that carries them across a stop."""

    def __init__(self, run_dir: Path, spec, rank: int, world_size: int, device, fmt: str = "pt",
                 async_save: bool = False, timeout_s: float = 300.0, slow_write_s: float = 0.0, chosen: bool = False):
        self.path = Path(run_dir) / rundir.CHECKPOINT
        self.objects: dict[str, Any] = {}
        self._spec, self._rank, self._world_size, self._device = spec, rank, world_size, device
        self._format = fmt   # pt: checkpoint.pt from rank 0; dcp: checkpoint/, every rank its shards
        self._chosen = chosen   # checkpoint.format set (pt or dcp), not auto
        self._sharded = sharded.ShardedCheckpoint(run_dir, rank, world_size, async_save, timeout_s, slow_write_s)
        # the loop's length (steps), saved: a resume that extends it checks the key's shift
        self.length: int | None = None
        self._read: dict | None = None   # the checkpoint file as read, once (peek, then load)
        self._peeked = False
        self._start_world = world_size   # the world size the run started with (world_change)

    def add(self, name: str, obj: Any) -> None:
        if isinstance(obj, dict):
            obj = _DictState(obj)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(f"run.track({name}=...): a {type(obj).__name__} has no state_dict() and "
                            "load_state_dict(); track modules, optimizers, schedulers, a GradScaler, "
                            "a dict of numbers, or objects of your own that have both")
        obj = unwrapped(obj)
        if self._format == "pt" and sharded.holds_shards(obj):
            if self._chosen:
                raise UserError(f"checkpoint.format=pt: run.track({name}=...) is sharded (its parameters are "
                                "DTensors: fully_shard), each rank holding a part, and checkpoint.pt would keep rank "
                                "0's part only; use checkpoint.format=dcp (or auto), where every rank saves its own")
            self._format = "dcp"   # auto: the task sharded its model itself, not launch.wrap=fsdp
        had = self.objects.get(name)
        if had is not None and _held(had) is not _held(obj):
            # the first one would be left out of the checkpoint without a word (a model, when its name went to
            # the optimizer); the same object again is no change
            raise UserError(f"run.track({name}=...): '{name}' tracks a {type(_held(had)).__name__} already; "
                            f"give the {type(_held(obj)).__name__} a name of its own")
        self.objects[name] = obj

    def kept(self, where: str, names: tuple[str, ...]) -> KeptLocals:
        """The loop variables run.steps or run.epochs (`where`) keeps: the same names each time (run.steps
        is called again every epoch), each rank's own values."""
        kept = self.objects.get(KEPT + where)
        if kept is None:
            kept = self.objects[KEPT + where] = KeptLocals(names, where)
        if kept.names != names:
            raise UserError(f"{where}: keep={names} this time, keep={kept.names} before; keep the same names")
        return kept

    def expect(self) -> dict:
        """The run shape a checkpoint must match to be resumed here (any world size: world_change)."""
        return {"task": self._spec.name, "fingerprint": self._spec.fingerprint}

    def peek(self) -> dict | None:
        """The checkpoint a resume will load, read once and kept (None when there is none): run.loader
        needs the world size the run started with before the loop loads it."""
        found = None if self._peeked else self._found()
        if found is not None:
            self._read = checkpoint.read(self._meta_file(found))
            if self._read.get("task") == self._spec.name:   # else load() says whose it is, first
                self._start_world = world_change.start_world(self._read, self._world_size)
        self._peeked = True
        return self._read

    def rank_batch(self, batch_size: int, resume: bool) -> int | None:
        """The per-rank batch size on this world for `batch_size` per rank at the run's start."""
        if resume:
            self.peek()
        return world_change.rank_batch(batch_size, self._start_world, self._world_size)

    @property
    def start_world(self) -> int:
        return self._start_world

    def check_loadable(self) -> None:
        """Objects of the user's own whose state a resume could not load: one line before training.
        Modules, optimizers, schedulers and scalers save tensors and numbers: not copied to check."""
        import torch

        own = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)
        for name, obj in self.objects.items():
            if not isinstance(obj, own):
                checkpoint.check_loadable(name, obj.state_dict())

    def load(self, lengths: dict[str, int] | None = None) -> dict | None:
        """The checkpoint to resume from, checked against this run (its shape, settings, tracked
        names), or None when there is none; nothing is restored yet (restore). `lengths`: the task
        keys whose values are the loop's length (max_steps, epochs): one of those may differ."""
        path = self._found()
        if path is None:
            return None
        state = checkpoint.load(self._meta_file(path), self.expect(), self._spec.identity, may_differ=lengths,
                                length=self.length, state=self.peek())
        self._read = None   # restored from here on; the run's own state moves on
        if path != self.path:
            state["dcp_dir"] = path
        elif self._has_shards():
            raise UserError(f"checkpoint {path} holds rank 0's whole model (checkpoint.format=pt, written unsharded "
                            "under launch.wrap=ddp); this run's model is sharded (launch.wrap=fsdp, or fully_shard "
                            "in the task), which cannot load it: resume it unsharded, or save it again there with "
                            "checkpoint.format=dcp, which a sharded model reads")
        # the variables an epoch's run.steps keeps are named when it starts, after this check
        saved = sorted(n for n in [*state["tracked"], *state.get("sharded", ())] if not n.startswith(KEPT))
        mine = sorted(n for n in self.objects if not n.startswith(KEPT))
        if saved != mine:
            raise UserError(f"checkpoint {self.path} tracks {', '.join(saved) or 'nothing'}, this run tracks "
                            f"{', '.join(mine) or 'nothing'} (run.track); resume with the same code or use a new "
                            "run dir")
        return state

    def _found(self) -> Path | None:
        """The checkpoint of this run dir: the configured format's, else the other one's (a run that
        switched between ddp and fsdp, or checkpoint.format); None when there is none."""
        dcp = self._sharded.where()
        found = [p for p in ((dcp, self.path) if self._format == "dcp" else (self.path, dcp))
                 if p is not None and p.exists()]
        return found[0] if found else None

    def _meta_file(self, found: Path) -> Path:
        """The file of `found` that holds the step, the ranks and the rest: checkpoint.pt itself, or a
        sharded checkpoint's expgpu.pt."""
        return found if found == self.path else self._sharded.meta_path(found)

    def _has_shards(self) -> bool:
        return any(sharded.holds_shards(o) for o in self.objects.values())

    def where(self, state: dict) -> tuple[int, int]:
        """(epoch, batch position) at which this rank resumes (rank 0's on another world size)."""
        return world_change.where(state, self._rank, self._world_size)

    def restore(self, state: dict) -> None:
        """The tracked objects (rank 0's; this rank's own dicts) and this rank's RNG, as saved; on
        another world size, the RNG reseeded from (seed, step, rank) (world_change)."""
        if "dcp_dir" in state:   # modules and optimizers from the shards, together (collective)
            self._sharded.restore(state["dcp_dir"], self._in_shards(), state.get("empty_optimizers", []))
        for name in self.objects:
            if name not in state.get("sharded", ()):
                self.restore_one(name, state)
        if world_change.changed(state, self._world_size):
            per_rank = self._spec.seed_per_rank
            rng.seed_all(world_change.reseed_value(self._spec.seed, state["step"], self._rank, per_rank))
            log.info("resuming %d rank(s) from a checkpoint of %d", self._world_size,
                     world_change.saved_world(state))
        else:
            rng.restore(state["ranks"][self._rank]["rng"], self._device)
        epoch, position = self.where(state)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", state.get("dcp_dir", self.path), state["step"],
                 epoch, position)

    def restore_one(self, name: str, state: dict) -> None:
        """One tracked object as saved: this rank's own state (a dict, kept variables), else rank 0's."""
        obj = self.objects.get(name)
        if obj is None:
            return
        if name not in state["tracked"]:   # kept loop variables (the rest was checked by load)
            raise UserError(f"checkpoint {self.path} keeps no {name[len(KEPT):]} variables; this run does "
                            "(keep=): resume with the same code or use a new run dir")
        own = world_change.own_value(state, name, self._rank, self._world_size, self.path)   # not rank 0's
        try:
            obj.load_state_dict(own if own is not None else state["tracked"][name])
        except UserError:
            raise
        except Exception as e:  # same settings, other code
            raise UserError(f"checkpoint {self.path}: {name} does not fit what this run tracks as {name} "
                            f"({type(e).__name__}: {first_line(e)}); use a new run dir") from None

    def save(self, step: int, where: tuple[int, int], metrics, reason: str, global_batch: int | None = None) -> None:
        """Collective: every rank calls it at the same step, `where` its (epoch, batch position);
        rank 0 (the one with `metrics`) writes. `global_batch`: the examples of one step, all ranks."""
        mine = {"rng": rng.capture(self._device), "epoch": where[0], "position": where[1],
                "tracked": {name: on_cpu(obj.state_dict()) for name, obj in self.objects.items()
                            if getattr(obj, "per_rank", False)}}
        shape = {"length": self.length, "world_size": self._world_size, "start_world_size": self._start_world,
                 "global_batch": global_batch}
        if self._format == "dcp":
            return self._save_sharded(step, mine, metrics, reason, shape)
        ranks = group.gather_objects(mine, self._world_size)
        if metrics is None:
            return
        metrics.write_out()   # the rows up to this step are on disk before the checkpoint is
        checkpoint.save(self.path, self._meta(step, ranks, metrics, self.objects, **shape))
        self._sharded.remove()
        log.info("checkpoint at step %d (%s): %s", step, reason, self.path)

    def _meta(self, step: int, ranks: list, metrics, objects: dict[str, Any], **more) -> dict:
        return {**self.expect(), "params": json.dumps(self._spec.identity, sort_keys=True, default=str),
                "step": step, "ranks": ranks, "tracked": {name: obj.state_dict() for name, obj in objects.items()},
                "metrics": metrics.state_dict(), **more}

    def _in_shards(self) -> dict[str, Any]:
        return {n: o for n, o in self.objects.items() if sharded.is_sharded_state(o)}

    def _save_sharded(self, step: int, mine: dict, metrics, reason: str, shape: dict) -> None:
        """checkpoint/: modules and optimizers by every rank (DCP), the rest in rank 0's expgpu.pt
        (every rank's `mine` joins it there, gathered once the shards are written)."""
        in_shards = self._in_shards()
        meta = None
        if metrics is not None:
            metrics.write_out()
            rest = {n: o for n, o in self.objects.items() if n not in in_shards}
            meta = self._meta(step, None, metrics, rest, sharded=sorted(in_shards),
                              empty_optimizers=sharded.empty_optimizers(in_shards), **shape)
        background = reason == "every_steps"
        self._sharded.save(step, mine, meta, in_shards, background=background)
        if metrics is not None and not background:   # (a background one may not be in place yet)
            self.path.unlink(missing_ok=True)   # the other format's, now older

    def settle(self) -> None:
        """An asynchronous save still being written: finished and in place (the run's end)."""
        self._sharded.settle()

    def checksums(self) -> tuple[str | None, str | None]:
        """Of every tracked module's state, and of its parameters alone: both equal on all ranks when DDP kept them
        in step; the parameters' also where buffers differ by rank (BatchNorm's running stats after the last
        forward, which DDP broadcasts from rank 0 at the next). Each byte is hashed once (a large model's end):
        the whole is the hash of the parameters' and the other entries' hashes. (None, None) without a module."""
        modules = {n: o for n, o in sorted(self.objects.items()) if hasattr(o, "named_parameters")}
        if not modules:
            return None, None
        import torch

        weights, others = hashlib.sha256(), hashlib.sha256()
        for name, module in modules.items():
            params = {key for key, _ in module.named_parameters()}
            for key, tensor in module.state_dict().items():
                if hasattr(tensor, "full_tensor"):   # a shard (fsdp): every rank gathers the whole (collective)
                    tensor = tensor.full_tensor()
                h = weights if key in params else others
                h.update(f"{name}.{key}".encode())
                h.update(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        whole = hashlib.sha256(weights.digest() + others.digest())
        return whole.hexdigest()[:16], weights.hexdigest()[:16]


def _held(obj: Any) -> Any:
    """What a tracked entry holds: the user's dict for a dict, else the object itself."""
    return obj.d if isinstance(obj, _DictState) else obj


class _DictState:
    """A plain dict tracked in place (the best metric so far, counters): its items are saved, and
    a resume puts the saved ones back into the same dict object the loop holds."""

    per_rank = True   # each rank's own, restored on that rank

    def __init__(self, d: dict):
        self.d = d

    def state_dict(self) -> dict:
        # NumPy scalars (np.mean's result) as Python numbers: torch.load(weights_only=True) reads those
        return {k: v.item() if type(v).__module__ == "numpy" and getattr(v, "ndim", 1) == 0 else v
                for k, v in self.d.items()}

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint's tensors come back on the CPU: each goes where the value it replaces was
        # (a hidden state on the rank's GPU), so the loop's next step finds it where it left it.
        placed = {k: placed_like(v, self.d[k]) if k in self.d else v for k, v in state.items()}
        self.d.clear()
        self.d.update(placed)
