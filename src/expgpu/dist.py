"""With whom: backend choice, process-group init and teardown, model wrapping."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

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

    launch = os.environ.get("EXPGPU_LAUNCH_ID", "0")
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
    try:
        yield
        # Tearing gloo down while a peer still sends its last messages can abort the
        # process (SIGABRT, "terminate called without an active exception"): meet first.
        # Only on the normal path: after an error the peers may never come.
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        _let_gloo_threads_finish()


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


def wrap(model, device, mode: str, world_size: int, n_gpus: int):
    """DDP across ranks (device_ids for CUDA), DataParallel over one rank's GPUs, or nothing."""
    import torch

    if mode == "dp":
        if device.type == "cuda" and n_gpus > 1:
            return torch.nn.DataParallel(model, device_ids=list(range(n_gpus)))
        return model
    if mode == "ddp" and world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index or 0] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    return model


def gather_objects(obj: Any, world_size: int) -> list:
    """Every rank's `obj`, in rank order, on every rank (collective; no group for one rank)."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: Sequence[float], device) -> list[float]:
    """Sums over ranks of a few numbers (collective), on the device the backend needs."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            t = t.to(device)
        dist.all_reduce(t)
    return [float(v) for v in t.cpu()]
