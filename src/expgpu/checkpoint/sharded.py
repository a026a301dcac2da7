"""The sharded checkpoint (checkpoint.format=dcp, the default under launch.wrap=fsdp).

RUN_DIR/checkpoint/ is a torch.distributed.checkpoint (DCP) directory: the tracked modules'
and optimizers' state (get_state_dict: parameter names without wrapper prefix, global shapes),
written by every rank for its own shards (no gather on rank 0), plus expgpu.pt, rank 0's file of
what is not sharded (the step, every rank's RNG and data position, schedulers, scalers, tracked
dicts, the metrics rows not yet written): the same state as checkpoint.pt's, checked the same way.

Atomic: every save goes into a temporary directory beside the final one; once every rank's
shards and .metadata are written (and fsynced, FileSystemWriter's sync_files), rank 0 writes
expgpu.pt last, moves the previous checkpoint aside, renames the new one into place and only
then deletes the old one. A checkpoint lacking .metadata, expgpu.pt or a shard file is an error
naming it, never a silent restart. Because DCP stores every tensor by name and global shape, a
checkpoint written under fsdp loads into ddp (and the reverse), and onto another sharding.

checkpoint.async_save: the shards are copied to host memory (DCP's staging), then written by a
background thread on a gloo group of its own (the training's collectives go on meanwhile); the
next save, the run's end or a stop waits for it (backend.timeout_s) before renaming it into place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import datetime
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from expgpu.errors import UserError
from expgpu.rundir import SHARDED_CHECKPOINT, fsync_dir

log = logging.getLogger("expgpu")

DIR = SHARDED_CHECKPOINT   # RUN_DIR/checkpoint/: the DCP directory
META = "expgpu.pt"      # inside it: rank 0's unsharded state, written last
_TMP = ".checkpoint.tmp-"
_OLD = ".checkpoint.old"
HINT = "move it away to start over, or point hydra.run.dir at another run"


def is_sharded_state(obj: Any) -> bool:
    """What DCP saves: modules and optimizers (their state by parameter name)."""
    import torch

    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def holds_shards(obj: Any) -> bool:
    """A module whose parameters are DTensors (FSDP2's fully_shard, by launch.wrap=fsdp or by the task's
    own code; tensor parallel): each rank holds a part, so only every rank's shards (DCP) keep it whole."""
    import torch

    tensor = sys.modules.get("torch.distributed.tensor")   # no DTensor exists before its import (~0.5 s)
    if tensor is None or not isinstance(obj, torch.nn.Module):
        return False
    return any(isinstance(p, tensor.DTensor) for p in obj.parameters())


class ShardedCheckpoint:
    """RUN_DIR/checkpoint/: saved by every rank (collective), read by every rank."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, asynchronous: bool, timeout_s: float,
                 slow_write_s: float = 0.0):
        self.run_dir = Path(run_dir)
        self._slow_write_s = slow_write_s   # faults.slow_write_s: a background save's write takes this longer
        self.path = self.run_dir / DIR
        self._rank, self._world_size = rank, world_size
        self._async, self._timeout_s = asynchronous, timeout_s
        self._group = None
        self._pending: tuple | None = None   # (a future done once the save in flight is in place, its step)
        if rank == 0:   # saves cut off before (a crash, then this resume): before any rank saves again,
            for stale in self.run_dir.glob(f"{_TMP}*"):   # which takes a collective that rank 0 has not reached
                shutil.rmtree(stale, ignore_errors=True)

    # -- saving ------------------------------------------------------------------------------------

    def save(self, step: int, mine: dict, meta: dict | None, objects: dict[str, Any], background: bool) -> None:
        """Collective. `mine`: this rank's own state (RNG, data position), gathered into expgpu.pt;
        `meta`: the rest of expgpu.pt (rank 0), None elsewhere. `background`: a periodic save under
        checkpoint.async_save, else written before this returns."""
        import torch.distributed.checkpoint as dcp

        self.settle()
        tmp = self.run_dir / f"{_TMP}{step}"
        state, _ = state_dicts(objects)
        writer = dcp.FileSystemWriter(str(tmp))
        if background and self._async:
            mine, meta = copy.deepcopy(mine), copy.deepcopy(meta)   # as they are now: training goes on
            staged = _HostCopy.of(state)   # the copy the training stalls for; written from it in the background
            with _single_process_quiet():
                future = dcp.async_save(staged.state if staged else state, storage_writer=writer,
                                        process_group=self.group(), no_dist=self._alone(), async_stager=staged)
            # renamed into place as soon as it is written, by the thread that wrote it: a crash
            # before the next save then loses nothing that was saved
            placed = concurrent.futures.Future()
            future.add_done_callback(lambda done: _place(done, placed, lambda: self._finish(tmp, step, mine, meta),
                                                         self._slow_write_s))
            self._pending = (placed, step)
            return
        with _single_process_quiet():
            dcp.save(state, storage_writer=writer, process_group=self.group(), no_dist=self._alone())
        self._finish(tmp, step, mine, meta)

    def settle(self) -> None:
        """The save in flight (async_save) finished and renamed into place; a wait with a timeout."""
        if self._pending is None:
            return
        placed, step = self._pending
        self._pending = None
        try:
            placed.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"checkpoint.async_save: the save of step {step} did not finish within "
                               f"{self._timeout_s:.0f}s (backend.timeout_s)") from None

    def _finish(self, tmp: Path, step: int, mine: dict, meta: dict | None) -> None:
        """Every rank's shards are written (the save's last collective): the ranks' own states are
        gathered (in the thread that saved, on the checkpoint group: off the training's path for an
        async save), and rank 0 writes expgpu.pt and renames the whole into place."""
        ranks = self._gather(mine)
        if self._rank != 0:
            return
        from expgpu.checkpoint import file as checkpoint
        from expgpu.rundir import atomic_write_bytes

        atomic_write_bytes(tmp / META, checkpoint.dumps({**meta, "ranks": ranks}))   # last: the rest is there
        fsync_dir(tmp)
        old = self.run_dir / _OLD
        if self.path.exists():
            if old.exists():   # left by a save cut off after its second rename: the final one is whole
                shutil.rmtree(old)
            self.path.rename(old)   # kept until the new one is in place
        tmp.rename(self.path)   # (with no final one, old is the one a resume read: it goes only now)
        fsync_dir(self.run_dir)
        shutil.rmtree(old, ignore_errors=True)
        log.info("sharded checkpoint at step %d: %s", step, self.path)

    def remove(self) -> None:
        """rank 0, after a checkpoint.pt was saved: this format's checkpoint, now the older one, goes."""
        for path in (self.path, self.run_dir / _OLD):
            shutil.rmtree(path, ignore_errors=True)

    def group(self):
        """A gloo group for checkpoints alone: an async save's collectives run in a thread beside the
        training's, which must not share a group with them (nor need CPU tensors on nccl)."""
        import torch.distributed as dist

        if self._world_size == 1 or not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self._timeout_s))
        return self._group

    def _gather(self, mine: dict) -> list:
        group = self.group()
        if group is None:
            return [mine]
        import torch.distributed as dist

        every: list = [None] * self._world_size
        dist.all_gather_object(every, mine, group=group)
        return every

    def _alone(self) -> bool:
        """One process and no group: DCP is told so (else it warns that it assumes it)."""
        return self.group() is None

    # -- loading -----------------------------------------------------------------------------------

    def where(self) -> Path | None:
        """The checkpoint directory to resume from: the final one, or the previous one when a save
        was cut off between its two renames; None when there is none."""
        if self.path.exists():
            return self.path
        old = self.run_dir / _OLD
        return old if (old / ".metadata").exists() and (old / META).exists() else None

    def meta_path(self, path: Path) -> Path:
        """expgpu.pt of `path`, after checking that the directory is whole (a one-line error if not)."""
        from torch.distributed.checkpoint import FileSystemReader

        if not (path / ".metadata").exists():
            raise UserError(f"checkpoint {path} is incomplete: it has no .metadata (its save was cut off); {HINT}")
        if not (path / META).exists():
            raise UserError(f"checkpoint {path} is incomplete: it has no {META} (its save was cut off); {HINT}")
        try:
            metadata = FileSystemReader(str(path)).read_metadata()
        except Exception as e:
            raise UserError(f"checkpoint {path}/.metadata is unreadable ({type(e).__name__}); {HINT}") from None
        sizes: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(sizes.items()):
            shard = path / name
            if not shard.exists():
                raise UserError(f"checkpoint {path} is incomplete: the shard {name} is missing; {HINT}")
            if shard.stat().st_size < size:
                raise UserError(f"checkpoint {path} is incomplete: the shard {name} is truncated "
                                f"({shard.stat().st_size} of {size} bytes); {HINT}")
        return path / META

    def restore(self, path: Path, objects: dict[str, Any], empty: list[str]) -> None:
        """Collective: the modules' and optimizers' state read into them, each rank its own shards.
        `empty`: optimizers saved before their first step (nothing to load)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        wanted = {n: o for n, o in objects.items() if n not in empty}
        state, owners = state_dicts(wanted, loading=True)
        reader = dcp.FileSystemReader(str(path))
        check_shapes(path, reader.read_metadata(), state, owners)
        with _single_process_quiet():
            dcp.load(state, storage_reader=reader, process_group=self.group(), no_dist=self._alone())
        for name, obj in wanted.items():
            if name in owners:
                set_optimizer_state_dict(owners[name], obj, state[name])
            else:
                set_model_state_dict(obj, state[name])


def _place(written, placed, finish, slow_s: float = 0.0) -> None:
    """An async save's last part, in its writer's thread: renamed into place once written."""
    try:
        written.result()
        if slow_s:
            time.sleep(slow_s)   # faults.slow_write_s: a slow file system, for the tests
        finish()
        placed.set_result(None)
    except BaseException as e:   # handed to settle(), which raises it in the training's thread
        placed.set_exception(e)


class _HostCopy:
    """An async save's staging when every tensor is in host memory already: each rank's local
    shards cloned as they are (5-10 ms for a 12 MiB rank on a CPU, where DCP's own stager took
    70-160 ms rebuilding every DTensor). None (DCP's stager) when a tensor is on an accelerator."""

    _synchronize_after_execute = False

    def __init__(self, state):
        self.state = state

    @classmethod
    def of(cls, state: dict) -> "_HostCopy | None":
        from torch.utils._pytree import tree_flatten, tree_map

        leaves, _ = tree_flatten(state)
        if any(getattr(t, "device", None) is not None and t.device.type != "cpu" for t in leaves):
            return None
        return cls(tree_map(_cloned, state))

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        return state_dict   # cloned already, in of()

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _cloned(value):
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "to_local"):   # a DTensor: its local shard cloned, its spec (place in the whole) shared
        return type(value)(value._local_tensor.detach().clone(), value._spec, requires_grad=False)
    return value.detach().clone()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every save of one process without a group, which is what a one-rank run is
    (an async save warns from its writer thread: the filter is the process's, for that message)."""
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    yield


def state_dicts(objects: dict[str, Any], loading: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """({name: its DCP state dict} for each tracked module and optimizer, {optimizer name: the
    module(s) it trains}). Saving, an optimizer with no state yet (before its first step) is left
    out: reading its state dict would make some (a step of lr 0), and so change the run; loading,
    that state is the frame DCP reads the saved one into."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)}
    state, owners = {}, {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            state[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer) and (obj.state or loading):
            owners[name] = _owner(name, obj, modules)
            state[name] = get_optimizer_state_dict(owners[name], obj)
    return state, owners


def empty_optimizers(objects: dict[str, Any]) -> list[str]:
    import torch

    return sorted(n for n, o in objects.items() if isinstance(o, torch.optim.Optimizer) and not o.state)


def _owner(name: str, opt, modules: dict[str, Any]):
    """The tracked module that holds `opt`'s parameters (a ModuleDict of them when it trains several):
    DCP names optimizer state by parameter name, so it needs the module the names come from."""
    import torch

    ids = {id(p) for group in opt.param_groups for p in group["params"]}
    holders = {n: m for n, m in modules.items() if ids & {id(p) for p in m.parameters()}}
    held = {id(p) for m in holders.values() for p in m.parameters()}
    if not holders or not ids <= held:
        raise UserError(f"run.track({name}=...): some of its parameters are in no tracked module; track the "
                        "model(s) it trains too (the sharded checkpoint names optimizer state by parameter name)")
    if len(holders) == 1:
        return next(iter(holders.values()))
    return torch.nn.ModuleDict(holders)


def check_shapes(path: Path, metadata, state: dict[str, Any], owners: dict[str, Any]) -> None:
    """Every tracked module's tensors are in the checkpoint with the same global shape, or one line
    naming the first that is not."""
    saved = metadata.state_dict_metadata
    for name, module_state in state.items():
        if name in owners:
            continue
        for key, tensor in module_state.items():
            if not hasattr(tensor, "shape"):
                continue
            entry = saved.get(f"{name}.{key}")
            if entry is None:
                raise UserError(f"checkpoint {path} has no {name}.{key}, which this run's {name} has "
                                "(another model); resume with the same model or use a new run dir")
            have = tuple(getattr(entry, "size", ()))
            if have != tuple(tensor.shape):
                raise UserError(f"checkpoint {path}: {name}.{key} has shape {list(have)} there, "
                                f"{list(tensor.shape)} in this run's {name}; resume with the same model or use "
                                "a new run dir")
        extra = sorted(k for k in saved if k.startswith(f"{name}.") and k[len(name) + 1:] not in module_state)
        if extra:
            raise UserError(f"checkpoint {path} has {extra[0]}, which this run's {name} does not (another "
                            "model); resume with the same model or use a new run dir")
