"""A run started by hand on a workstation leases its GPUs, as a gpu_pool job does (expgpu.pool.leases).

`python -m expgpu task=a` beside a gpu_pool sweep would otherwise plan on GPUs the sweep's jobs hold (and the
sweep could start a job on this run's GPU before its CUDA context shows in NVML). So before its ranks start,
the run plans, leases the GPUs of its plan (the lock files every sweep of the machine shares), and holds the
leases until it ends. Where a GPU of the plan is leased, it plans again on the GPUs no one leases, and says
which it left out and why; where those are too few, it is one line naming the holders, exit 2, before anything
ran. Either way the process then sees only its leased GPUs (CUDA_VISIBLE_DEVICES, as a pool job's), so its
ranks' plan, made again from that mask, is the one leased.

Only where expgpu starts the ranks itself on this machine's real GPUs: not under torchrun, srun or a SLURM
job (their GPUs are the launcher's), not in a gpu_pool job (the pool leased them), not on simulated GPUs
(made up: nothing to share), not for a dry run, not with launch.lease_gpus=false (a GPU shared on purpose).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from expgpu import envvars
from expgpu.errors import UserError
from expgpu.gpus import inventory, placement
from expgpu.gpus.mask import gpu_env
from expgpu.procs.environ import kept
from expgpu.ranks import RankInfo

MASK_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def applies(plain: dict, info: RankInfo, env=os.environ) -> bool:
    return (plain["launch"]["lease_gpus"] and info.source == "single" and "SLURM_JOB_ID" not in env
            and envvars.POOL_JOB not in env and plain["inventory"]["simulate"] is None)


@contextlib.contextmanager
def held(plain: dict, nproc: int, run_dir) -> Iterator[list]:
    """The leases of the run's GPUs while it runs (none on a CPU), this process narrowed to them."""
    gpus = inventory(None)
    if not gpus:
        yield []
        return
    from expgpu.pool import leases  # here, on a machine with GPUs only: the pool package costs ~25 ms

    try:
        directory = leases.lease_dir()
    except UserError as e:   # no lease dir to write: the run goes on as before leases, and says so
        print(f"expgpu: warning: its GPUs are not leased ({e}); a gpu_pool sweep may start jobs on them",
              file=sys.stderr, flush=True)
        yield []
        return
    taken: list = []
    with kept(*MASK_KEYS) as before:
        try:
            taken = _take(plain, nproc, gpus, directory)
            for lease in taken:
                lease.note(pid=os.getpid(), run=str(run_dir))
            if taken:
                os.environ.update(gpu_env([lease.gpu for lease in taken], before["CUDA_DEVICE_ORDER"]))
            yield taken
        finally:
            leases.release_all(taken)


def _take(plain: dict, nproc: int, gpus: list, directory) -> list:
    """Leases of the GPUs the run plans on: on all of this process's GPUs, else on those no one leases."""
    from expgpu.pool import leases

    planned = _gpus_of(placement.compute(plain, nproc))
    got = leases.acquire_free(directory, planned)
    if len(got) == len(planned):
        return got
    leases.release_all(got)
    free = leases.acquire_free(directory, gpus)   # held while it plans again: no one takes them meanwhile
    held_by = [g for g in gpus if g.index not in {lease.gpu.index for lease in free}]
    holders = "; ".join(f"GPU {g.index}: {leases.describe_holder(leases.noted(directory, g))}" for g in held_by)
    with kept(*MASK_KEYS) as mask:   # planned on the free GPUs alone
        os.environ.update(gpu_env([lease.gpu for lease in free], mask["CUDA_DEVICE_ORDER"]))
        try:
            if not free:
                raise UserError(f"every GPU this run may use is leased by other expgpu jobs ({holders}): wait for "
                                "them, or queue the run in a sweep (hydra/launcher=gpu_pool waits for its GPUs)")
            planned = _gpus_of(placement.compute(plain, nproc))
        except UserError as e:
            leases.release_all(free)
            raise UserError(f"{e} (leased by other expgpu jobs: {holders})" if holders not in str(e) else str(e)) \
                from None
    keep = [lease for lease in free if lease.gpu.index in {g.index for g in planned}]
    leases.release_all([lease for lease in free if lease not in keep])
    print(f"expgpu: leased by other expgpu jobs: {holders}; this run plans on the GPUs no one leases: GPU "
          f"{','.join(str(g.index) for g in planned)}", file=sys.stderr, flush=True)
    return sorted(keep, key=lambda lease: [g.index for g in planned].index(lease.gpu.index))


def preview(node) -> str | None:
    """A dry run's word on the plan's GPUs that other expgpu jobs lease now (the run would plan around them),
    a line ending in a newline; None when none are (or the lease dir cannot be read)."""
    planned = _gpus_of(node)
    if not planned:
        return None
    from expgpu.pool import leases

    try:
        directory = leases.lease_dir()
    except UserError:
        return None
    taken = [(g, leases.holder(directory, g)) for g in planned]
    taken = [f"GPU {g.index}: {leases.describe_holder(h)}" for g, h in taken if h is not None]
    if not taken:
        return None
    return (f"leased by other expgpu jobs now: {'; '.join(taken)}: the run would plan around them "
            "(launch.lease_gpus=false: on them all the same)\n")


def _gpus_of(node) -> list:
    """The plan's GPUs, each once, in the order of its ranks."""
    return list({g.index: g for gpus in node.assignments for g in gpus}.values())
