"""With whom: backend choice, process-group init and teardown, model wrapping."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from pathlib import Path
from typing import Iterator, Sequence

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

    from expgpu.checkpoint import atomic_write_bytes, wait_for_file

    launch = os.environ.get("EXPGPU_LAUNCH_ID", "0")
    port_file = run_dir / ".expgpu" / f"store-{launch}.port"
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.rank == 0:
        store = dist.TCPStore(info.master_addr, 0, info.world_size, True, timeout=timeout,
                              wait_for_workers=False)
        port_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(port_file, str(store.port).encode())
        return store
    port = int(wait_for_file(port_file, timeout_s, f"rank {info.rank}: rank 0 published no store port"))
    return dist.TCPStore(info.master_addr, port, info.world_size, False, timeout=timeout)


def _store(info: RankInfo, run_dir: Path, timeout_s: float):
    """The rendezvous store, made here so that teardown can use it too; None under torchrun,
    whose agent hosts one (env://)."""
    import torch.distributed as dist

    if info.source == "local" and info.master_port == 0:
        return _local_store_port(info, run_dir, timeout_s)
    if info.source == "torchrun":
        return None
    # What init_method="tcp://ADDR:PORT" would make: rank 0 hosts, the others connect.
    return dist.TCPStore(info.master_addr, info.master_port, info.world_size, info.rank == 0,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _leave_together(store, info: RankInfo, timeout_s: float) -> None:
    """After every rank has destroyed its process group, and not before, the store's host
    (rank 0) may exit and close the store.

    torchrun's agent hosts the store and outlives its workers; here rank 0 hosts it, and
    a rank 0 that exits while a peer is still tearing its group down is a race that ends
    the peer with SIGABRT ("terminate called without an active exception") now and then.
    """
    if store.add("expgpu/left", 1) == info.world_size:
        store.set("expgpu/all_left", "1")
    if info.rank == 0:
        with contextlib.suppress(Exception):  # a peer gone at this point has finished anyway
            store.wait(["expgpu/all_left"], datetime.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def process_group(info: RankInfo, backend: str, timeout_s: float, run_dir: Path,
                  device=None) -> Iterator[None]:
    """init_process_group with a timeout on every wait; destroy it whatever happens.

    The body must drop what holds the group (the DDP model) before it ends, so that the
    group is freed inside destroy_process_group, while the interpreter is whole, not at
    some later garbage collection or during interpreter shutdown.
    """
    if info.world_size == 1:
        yield
        return
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict = dict(backend=backend, rank=info.rank, world_size=info.world_size, timeout=timeout)
    if backend == "nccl" and device is not None:
        kwargs["device_id"] = device  # bind now: no NCCL context on another GPU
    store = _store(info, run_dir, timeout_s)
    if store is None:
        kwargs["init_method"] = "env://"  # the torchrun agent hosts the store
    else:
        kwargs["store"] = store
    dist.init_process_group(**kwargs)
    normal = False
    try:
        yield
        # Tearing gloo down while a peer still sends its last messages can abort the
        # process (SIGABRT, "terminate called without an active exception"): meet first.
        # Only on the normal path: after an error the peers may never come.
        dist.barrier()
        normal = True
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        gc.collect()  # the group's last references (cycles around DDP's hooks) go now
    if normal and store is not None:
        _leave_together(store, info, timeout_s)


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


def unwrap(model):
    return getattr(model, "module", model)
