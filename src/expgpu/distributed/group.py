"""With whom: backend choice, process-group init and teardown, collectives (run.wrap: expgpu.distributed.wrap)."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from expgpu import envvars
from expgpu.errors import UserError
from expgpu.ranks import RankInfo


def choose_backend(requested: str, node_gpus: Sequence[Sequence], cuda_available: bool) -> str:
    """nccl only when every local rank owns a CUDA device of its own; gloo otherwise.

    `node_gpus` is the plan of this node: the GPU indices of every local rank.
    """
    own_gpu = bool(node_gpus) and all(len(g) > 0 for g in node_gpus)
    firsts = [g[0] for g in node_gpus if g]
    shared = len(set(firsts)) < len(firsts)
    if requested == "auto":
        return "nccl" if cuda_available and own_gpu and not shared else "gloo"
    if requested == "nccl":
        if not cuda_available or not own_gpu:
            raise UserError("backend=nccl needs a CUDA GPU for every rank, but this node has "
                            f"{'no usable CUDA' if not cuda_available else 'ranks without a GPU'}; "
                            "use backend=gloo or backend=auto")
        if shared:
            raise UserError("backend=nccl cannot put two ranks of one node on one GPU (NCCL refuses "
                            "duplicate devices); give each rank its own GPU or use backend=gloo")
    return requested


def _local_store_port(info: RankInfo, run_dir: Path, timeout_s: float):
    """expgpu's own spawn: rank 0 binds a free port and publishes it in the run dir.

    Picking a port in the parent and handing it down leaves a window in which a
    concurrent run can take it; binding it where it is used does not.
    """
    import torch.distributed as dist

    from expgpu.rundir import atomic_write_bytes, store_port_file, wait_for_file

    launch = os.environ.get(envvars.LAUNCH_ID, "0")
    port_file = store_port_file(run_dir, launch)
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.rank == 0:
        store = dist.TCPStore(info.master_addr, 0, info.world_size, True, timeout=timeout,
                              wait_for_workers=False)
        port_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(port_file, str(store.port).encode())
        return store
    port = int(wait_for_file(port_file, timeout_s, f"rank {info.rank}: rank 0 published no store port"))
    return dist.TCPStore(info.master_addr, port, info.world_size, False, timeout=timeout)


@contextlib.contextmanager
def process_group(info: RankInfo, backend: str, timeout_s: float, run_dir: Path,
                  device=None) -> Iterator[None]:
    """init_process_group with a timeout on every wait; destroy it whatever happens."""
    if info.world_size == 1:
        yield
        return
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict = dict(backend=backend, rank=info.rank, world_size=info.world_size, timeout=timeout)
    if backend == "nccl" and device is not None:
        kwargs["device_id"] = device  # bind now: no NCCL context on another GPU
    if info.source == "local" and info.master_port == 0:
        kwargs["store"] = _local_store_port(info, run_dir, timeout_s)
    elif info.source == "torchrun":
        kwargs["init_method"] = "env://"  # the torchrun agent hosts the store
    else:
        kwargs["init_method"] = f"tcp://{info.master_addr}:{info.master_port}"
    dist.init_process_group(**kwargs)
    global _cpu_group
    try:
        if backend == "nccl":
            # Side traffic of a few numbers (the stop poll) on the CPU: reading an nccl result back
            # would wait for every kernel queued before it, a stall a plain loop does not have.
            _cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        yield
        # Tearing gloo down while a peer still sends its last messages can abort the
        # process (SIGABRT, "terminate called without an active exception"): meet first.
        # Only on the normal path: after an error the peers may never come.
        dist.barrier()
    finally:
        _cpu_group = None
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        _let_gloo_threads_finish()


_cpu_group = None   # a gloo group beside an nccl one (process_group); None: the default group is gloo


def store():
    """The process group's store (a TCPStore, or the torchrun agent's), for side channels such as the
    hang watchdog's; None without a group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def cpu_group():
    """The process group for small CPU tensors: the default group, unless that one is nccl."""
    return _cpu_group


def _let_gloo_threads_finish() -> None:
    """Give the group's worker threads the GIL once, before this process may end.

    destroy_process_group does not free a gloo group that DDP used (its reducer keeps it
    alive in C++), so the group's worker threads live on. Such a thread frees its last
    finished collective a moment after completing it, and that takes the GIL; if the
    interpreter is shutting down by then, the thread is killed and the process aborts
    (SIGABRT, "terminate called without an active exception"; pytorch PR #179291). A
    plain mp.spawn DDP script ends so about 1 run in 6 on this 2-core machine, expgpu's
    workers now and then. Sleeping releases the GIL, and a thread waiting for it takes it.
    """
    time.sleep(0.05)


def gather_objects(obj: Any, world_size: int) -> list:
    """Every rank's `obj`, in rank order, on every rank (collective; no group for one rank)."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: Sequence[float], device) -> list[float]:
    """Sums over ranks of a few numbers (collective), in one all-reduce."""
    import torch

    return reduce_value(torch.tensor(list(values), dtype=torch.float64), "sum", device).tolist()


REDUCE_OPS = ("sum", "mean", "max", "min")


def reduce_value(value: Any, op: str, device, what: str = "value") -> Any:
    """`value` (a tensor, a number, or a dict of them) reduced over all ranks: Run.all_reduce.

    Collective: every rank calls it with the same structure. Dict entries go in key order, so
    ranks that built their dicts in another order still pair them up. Out of place: a tensor
    comes back as a new tensor on its own device (a CPU tensor visits the rank's GPU under nccl),
    detached: this is for metrics, not for gradients.
    """
    if op not in REDUCE_OPS:
        raise UserError(f"run.all_reduce(op={op!r}) is not allowed: {', '.join(REDUCE_OPS)}")
    if isinstance(value, dict):
        return by_key(value, lambda v, where: reduce_value(v, op, device, where), what, "run.all_reduce", "reduces")
    import torch

    if isinstance(value, torch.Tensor):
        return _reduce_tensor(value, op, device)
    if getattr(value, "ndim", 0) > 0 and hasattr(value, "__array__"):   # a NumPy array: one back
        return _reduce_tensor(torch.as_tensor(value), op, device).numpy()
    if isinstance(value, (int, float)) or hasattr(value, "item"):   # bool, numpy scalars too
        number = value.item() if hasattr(value, "item") else value
        exact = isinstance(number, int) and op != "mean"
        t = _reduce_tensor(torch.tensor(number, dtype=torch.int64 if exact else torch.float64), op, device)
        return int(t) if exact else float(t)
    raise UserError(f"run.all_reduce: {what} is a {type(value).__name__}; reduce tensors, numbers "
                    "or dicts of them")


def by_key(value: dict, each, what: str, call: str, verb: str) -> dict:
    """A collective over a dict (run.all_reduce, run.gather): `each(entry, its name)` entry by entry, in key order,
    so ranks that built their dicts in another order still pair them up; back in this rank's order. The keys are
    checked once, at the top (`what` "value")."""
    if what == "value":
        same_keys(value, call, verb)
    done = {k: each(value[k], f"{what}[{k!r}]") for k in sorted(value, key=repr)}
    return {k: done[k] for k in value}


def same_keys(value: dict, call: str, verb: str) -> None:
    """Every rank gives `call` a dict with the same keys, or all of them stop with one line: entries
    paired by name must not pair with another rank's next collective (a hang, or wrong sums)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return

    def keys(d: dict, path: str = "") -> list[str]:
        return sorted(k for name, v in d.items()
                      for k in (keys(v, f"{path}{name}.") if isinstance(v, dict) else [f"{path}{name}"]))

    mine = keys(value)
    every = gather_objects(mine, dist.get_world_size())
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            raise UserError(f"{call}: rank {rank} {verb} the keys {', '.join(theirs) or 'none'}, rank 0 "
                            f"{', '.join(every[0]) or 'none'}; every rank must give the same keys")


def _reduce_tensor(t, op: str, device):
    import torch.distributed as dist

    out = t.detach().clone()
    if op == "mean" and not out.is_floating_point():
        out = out.double()   # the mean of integers is not an integer
    if not dist.is_initialized():
        return out
    visit = dist.get_backend() == "nccl" and out.device.type != "cuda"
    work = out.to(device) if visit else out
    reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,   # AVG is nccl's only
                 "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(work, op=reduce_op)
    if op == "mean":
        work /= dist.get_world_size()
    return work.to(t.device) if visit else work


def barrier() -> None:
    """Every rank waits here for the others (no-op on one rank); the group's timeout applies."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def gpu_idle(device):
    """A call that says whether the device has run out of queued work: on a GPU, whether its current stream has
    drained (cudaStreamQuery, about a microsecond); on the CPU, which computes in this thread, always. A loop
    that fetched its batch while the GPU still computed lost nothing to the fetch."""
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.current_stream(device).query
    return lambda: True


def sync_device(device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously): before a time is read."""
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(device)
