"""launch(): one batch of a sweep's jobs (Hydra calls it once per sweep, or once per trial under an
optimizing sweeper): settings, the GPUs, every job's config, each job's CPU threads, then the loop."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from expgpu import procs
from expgpu.errors import UserError, plural
from expgpu.pool import allocation, busy, sharing
from expgpu.pool import jobs as jobfiles
from expgpu.pool.allocation import Allocation
from expgpu.pool.compose import settle, stop_if_asked, thaw
from expgpu.pool.jobs import Job, Record
from expgpu.pool.kept import keep_finished
from expgpu.pool.scheduler import at_once, thread_budget
from expgpu.pool.settings import Settings, job_need, job_nodes, need_in_allocation, pool_gpus, settings
from expgpu.pool.spares import SPARES_LOG, Spare, primable, spare_env, task_modules
from expgpu.procs.forkserver import ForkServer

log = logging.getLogger("expgpu.pool")


def launch(params: Mapping[str, Any], hydra_context, task_function, config,
           job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    pool = open_pool(params, hydra_context, task_function, config,
                     [(list(o), initial_job_idx + i) for i, o in enumerate(job_overrides)])
    try:
        pool.run()
    finally:
        close_pool(pool)
    pool.summary(log)
    if pool.stop_signal is not None:
        raise KeyboardInterrupt
    return [job.ret for job in pool.jobs]


def start_server_ahead(params: Mapping[str, Any], config) -> None:
    """At the launcher's set-up: the sweep's fork server starts importing torch now (seconds), and the first
    launch() takes it (_server). Hydra's sweepers do their own work between the set-up and the first batch:
    the basic sweeper composes every job of a grid to check it (a 300-job grid: ~2 s), expgpu_optuna opens
    its study and asks the first trials; the server used to start only after that. Nothing is said here:
    a bad setting is launch()'s to report, and inside a SLURM allocation there is no fork server."""
    try:
        if allocation.detect(os.environ) is not None:
            return
        simulate = _simulated(config)
        gpus = pool_gpus(settings(params), simulate)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        state = sweep_dir / jobfiles.STATE
        made = not sweep_dir.exists()
        state.mkdir(parents=True, exist_ok=True)
        server = _server(state, bool(gpus), task_modules(config, not gpus or simulate is not None))
    except Exception:   # launch() meets it again and says what it is
        return
    _keep(server, state, bool(gpus))
    if made:
        _made.add(sweep_dir)


def _simulated(config):
    """The sweep's inventory.simulate (GPUs made up for a CPU machine), as plain data; None: the real ones."""
    from omegaconf import OmegaConf

    simulate = OmegaConf.select(config, "inventory.simulate", default=None)
    return OmegaConf.to_container(simulate, resolve=True) if OmegaConf.is_config(simulate) else simulate


def open_pool(params: Mapping[str, Any], hydra_context, task_function, config, first: list[tuple[list[str], int]],
              max_parallel: int | None = None, planned: int = 0):
    """A Pool with the jobs `first` ((overrides, job number) each) queued, its fork server and the first
    wave's spares warming up, and the shared context written; close_pool() after. max_parallel narrows
    hydra.launcher.max_parallel (an optimizing sweeper's n_jobs); `planned`: the jobs to come in all,
    like the first (the threads per job are shared out for them)."""
    from hydra.core.utils import configure_log, setup_globals

    from expgpu.pool import leases

    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    s = settings(params)
    if max_parallel is not None:
        s = dataclasses.replace(s, max_parallel=min(s.max_parallel or max_parallel, max_parallel))
    procs.atexit_grace_s()   # a bad EXPGPU_ATEXIT_GRACE_S: one line now, before any job starts
    alloc = allocation.detect(os.environ)
    if alloc is not None:
        return _open_in_allocation(alloc, s, hydra_context, task_function, config, first, planned)
    _say_what_only_an_allocation_reads(s)
    simulate = _simulated(config)
    gpus = pool_gpus(s, simulate)
    sharing.check(s, bool(gpus))
    sweep_dir = Path(str(config.hydra.sweep.dir))
    state = sweep_dir / jobfiles.STATE
    state.mkdir(parents=True, exist_ok=True)
    lease_dir = leases.lease_dir(s.lease_dir) if gpus else None
    # The first wave's processes warm up (torch: most of a job's start-up) while the jobs' configs
    # are composed: with the modules the sweep's own config names, then those of its first job.
    own_code = not gpus or simulate is not None
    warm = task_modules(config, own_code)
    first_wave = min(len(first), len(gpus) * s.jobs_per_gpu or s.cpu_slots, s.max_parallel or math.inf)
    server = _server(state, bool(gpus), warm)
    spares = [Spare(state, hide_gpus=bool(gpus), server=server) for _ in range(first_wave)]
    try:
        jobs = _compose_all(hydra_context, config, first, s, gpus)
    except BaseException:
        for spare in spares:
            spare.dismiss()
        _close(server, state)
        raise
    more = [m for m in (task_modules(jobs[0].config, own_code) if jobs else []) if m not in warm]
    if more:   # the first wave's forks are made already (or soon): they import these themselves
        server.warm(more)
        for spare in spares:
            spare.warm(more)
    warm += more
    slots = sharing.shares(gpus, s.jobs_per_gpu)   # what the jobs take: the GPUs, or jobs_per_gpu shares of each
    threads, job_env, threads_text = _threads(s, [j.need for j in jobs] + [jobs[0].need] * (planned - len(jobs)),
                                              slots)
    if gpus:
        desc = f"GPU {','.join(str(g.index) for g in gpus)}" + (" (simulated)" if simulate is not None else "") \
            + (f", {s.jobs_per_gpu} jobs on each" if s.jobs_per_gpu > 1 else "")
    else:
        desc = f"{s.cpu_slots} CPU slot{'s' if s.cpu_slots > 1 else ''}"
    log.info("gpu_pool: %s on %s, %s; sweep dir %s", _how_many(len(jobs), planned), desc, threads_text, sweep_dir)
    for job in jobs:
        log.info("\t#%d : %s", job.num, job.label)
    pool = _pool(jobs, slots, s, sweep_dir, lease_dir, desc, spares, (hydra_context, task_function),
                 Record(sweep_dir, gpus, s.cpu_slots, threads_text, simulate is not None and bool(gpus),
                        jobs_per_gpu=s.jobs_per_gpu),
                 job_env, threads, warm, own_code, server)
    if gpus and s.busy_gpus == "wait" and s.gpus_per_job != 0:   # GPUs that others compute on wait (pool.busy)
        pool.others = busy.Others(simulate)
    return pool


_SAID: set[str] = set()   # warnings given in this process: once, not at each launch() of a batch-by-batch sweeper


def _say_what_only_an_allocation_reads(s: Settings) -> None:
    """A warning, not an error: one config may serve a workstation and a cluster, and these keys ask nothing of
    this machine; but a user who set one for this sweep should know that it changed nothing here."""
    unread = [f"hydra.launcher.{key}={value}" for key, value, default in
              (("max_requeues", s.max_requeues, 0), ("warm_starts", str(s.warm_starts).lower(), "true"))
              if value != default]
    text = (f"gpu_pool: {', '.join(unread)}: read inside a SLURM allocation only (salloc, sbatch); this sweep runs "
            "on this machine, where it changes nothing")
    if unread and text not in _SAID:
        _SAID.add(text)
        log.warning(text)


def _how_many(now: int, planned: int) -> str:
    """The jobs in the pool's first line: an optimizing sweeper hands it one trial at a time (expgpu.pool.session),
    and "1 job" there read as the whole sweep."""
    return plural(now, "job") if planned <= now else f"{planned} jobs, each as the sweeper asks for it,"


def _open_in_allocation(alloc: Allocation, s: Settings, hydra_context, task_function, config,
                        first: list[tuple[list[str], int]], planned: int = 0):
    """The pool inside a SLURM allocation: its GPUs on every node (or, without GPUs, hydra.launcher.cpu_slots
    on every node), each job an srun step (expgpu.pool.steps); no spares, no fork server, no machine-wide
    leases (the allocation's GPUs are its own, and SLURM never gives one to two steps)."""
    if s.gpus is not None:
        raise UserError(f"hydra.launcher.gpus={list(s.gpus)} is not allowed inside a SLURM allocation: all "
                        f"(the allocation's GPUs, {alloc.describe()})")
    if not alloc.gpus_per_node and s.gpus_per_job:
        raise UserError(f"hydra.launcher.gpus_per_job={s.gpus_per_job} is not allowed in {alloc.describe()}, "
                        "which has no GPUs: null or 0 (each job takes a CPU slot on each of its nodes, "
                        "hydra.launcher.cpu_slots per node); or ask salloc/sbatch for GPUs (--gres=gpu:N)")
    sharing.check_in_allocation(s, bool(alloc.gpus_per_node))
    alloc = allocation.on_cpu_slots(alloc, s.cpu_slots) if allocation.cpu_jobs(alloc, s) else alloc
    gpus = sharing.shares(alloc.slots(), s.jobs_per_gpu)   # jobs_per_gpu shares of each (expgpu.pool.sharing)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    (sweep_dir / jobfiles.STATE).mkdir(parents=True, exist_ok=True)
    jobs = _compose_all(hydra_context, config, first, s, gpus, alloc)
    threads = (f"{s.threads_per_job} thread(s) per job (hydra.launcher.threads_per_job)" if s.threads_per_job
               else f"threads per job as set ({procs.user_threads()})" if procs.user_threads()
               else "threads per job: the step's CPUs (its share of the node's)")
    desc = alloc.describe() + (f", {s.jobs_per_gpu} jobs on each GPU" if s.jobs_per_gpu > 1 else "")
    how = "each forked by its nodes' warm processes" if s.warm_starts else "each an srun step"
    log.info("gpu_pool: %s on %s, %s; %s; sweep dir %s", _how_many(len(jobs), planned), desc, how, threads, sweep_dir)
    for job in jobs:
        log.info("\t#%d : %s", job.num, job.label)
    record = Record(sweep_dir, alloc.slots(), 0, threads, False, allocation={
        "job_id": alloc.job_id, "nodes": {n: list(alloc.gpus[n]) for n in alloc.nodes},
        **({"cpu_slots_per_node": s.cpu_slots} if alloc.cpu else {})}, jobs_per_gpu=s.jobs_per_gpu)
    pool = _pool(jobs, gpus, s, sweep_dir, None, desc, [], (hydra_context, task_function), record, {}, None, [],
                 False, None, alloc)
    if s.warm_starts and (not jobs or any(j.state == "queued" for j in jobs)):
        _warm_nodes(pool, alloc, config, sweep_dir)
    return pool


def _warm_nodes(pool, alloc: Allocation, config, sweep_dir: Path) -> None:
    """A warm process on every node of the allocation (expgpu.pool.node_servers), that forks the jobs there:
    torch and expgpu's modules imported (not the task's own: on real GPUs a module may start CUDA at import,
    spares.task_modules says why), the shared context unpickled ahead."""
    from expgpu.pool import node_servers
    from expgpu.pool.steps import step_env

    state = sweep_dir / jobfiles.STATE
    try:
        pool.node_servers = node_servers.start_all(alloc, task_modules(config, False), state / SPARES_LOG,
                                                   f"expgpu-pool-{os.getpid()}-warm", step_env(os.environ, {}))
    except OSError as e:
        log.warning("gpu_pool: warm starts off: could not start srun (%s); each job is an srun step", e)
        return
    for server in pool.node_servers.values():
        server.send({"warm": [], "path": list(sys.path), "context": str(pool.context)})


def _compose_all(ctx, config, first: list[tuple[list[str], int]], s: Settings, gpus: list,
                 alloc: Allocation | None = None) -> list[Job]:
    """Every job of the batch, composed and checked as its start will check it (expgpu.config's ranges, a
    script task's args: expgpu.script.spec.checked), before any starts: one line for the sweep, not a failure
    per job. (An optimizing sweeper's trials, composed one at a time, fail one by one instead.)"""
    from expgpu import config as expgpu_config
    from expgpu.pool.job_config import in_job
    from expgpu.script import spec

    jobs = []
    for overrides, num in first:
        stop_if_asked(f"composing the batch ({len(jobs)} of {len(first)} jobs)")
        jobs.append(compose_job(ctx, config, overrides, num, s, gpus, alloc))
        settle(len(jobs))
    for job in jobs:
        if expgpu_config.is_expgpu(job.config):
            in_job(job.config, expgpu_config.check)
            in_job(job.config, lambda c: spec.checked(c, os.getcwd()))
    kept = keep_finished(jobs)
    if kept:
        log.info("gpu_pool: %d job(s) finished in an earlier run of this sweep dir, kept (not started again): %s",
                 len(kept), " ".join(f"#{j.num}" for j in kept))
    return jobs


def compose_job(ctx, config, overrides: Sequence[str], num: int, s: Settings, gpus: list,
                alloc: Allocation | None = None) -> Job:
    """Job number `num`, composed as Hydra's launchers do, checked against the pool's GPUs (inside a SLURM
    allocation: against its nodes and their GPUs)."""
    gpus = sharing.physical(gpus)   # a job's GPUs are different cards, whatever their shares
    job = jobfiles.compose(ctx, config, overrides, num, lambda cfg: job_need(cfg, s, len(gpus)))
    job.nodes, key = job_nodes(job.config, s)
    if alloc is not None:
        job.need = need_in_allocation(job.config, s, alloc, job.nodes)
        how = ("hydra.launcher.gpus_per_job" if s.gpus_per_job is not None
               else "launch.nproc_per_node x gpu_map.gpus_per_rank")
        allocation.check_job(f"job #{job.num} ({job.label})", job.need, job.nodes, alloc, key, how)
        return job
    if job.nodes > 1:
        raise UserError(f"{key}={job.nodes} (job #{job.num}) is allowed only inside a SLURM allocation (salloc, "
                        "sbatch); here every job runs on this machine: 1")
    if job.need > len(gpus):
        how = ("hydra.launcher.gpus_per_job" if s.gpus_per_job is not None
               else "launch.nproc_per_node x gpu_map.gpus_per_rank")
        raise UserError(f"job #{job.num} ({job.label}) needs {job.need} GPUs ({how}), but the pool has "
                        f"{len(gpus)} ({', '.join(str(g.index) for g in gpus)}); ask for fewer per job, "
                        "or set hydra.launcher.gpus")
    return job


def _threads(s: Settings, needs: list[int], gpus: list) -> tuple[int | None, dict[str, str], str]:
    """(threads per job or None to leave them be, the variables each job gets, the start line's words).

    Unless the user chose (OMP_NUM_THREADS / MKL_NUM_THREADS, or hydra.launcher.threads_per_job),
    each job gets its share of the cores: the cores over the jobs that can run at once."""
    user = procs.user_threads()
    if s.threads_per_job is not None:
        if user:
            log.warning("gpu_pool: hydra.launcher.threads_per_job=%d is used for the jobs, not %s",
                        s.threads_per_job, user)
        n = s.threads_per_job
        return n, procs.threads_env(n), f"{n} thread{'s' if n > 1 else ''} per job (hydra.launcher.threads_per_job)"
    if user:
        return None, {}, f"threads per job as set ({user})"
    cores = procs.cores()
    n = thread_budget(cores, needs, len(gpus), s.cpu_slots, s.max_parallel)
    together = at_once(needs, len(gpus), s.cpu_slots, s.max_parallel)
    return n, procs.threads_env(n), (f"{n} thread{'s' if n > 1 else ''} per job ({cores} cores, {together} "
                                     f"job{'s' if together > 1 else ''} at once; hydra.launcher.threads_per_job "
                                     "to choose)")


def _pool(jobs: list[Job], gpus: list, s: Settings, sweep_dir: Path, lease_dir, desc: str, spares: list[Spare],
          shared: tuple, record: Record, job_env: dict, threads: int | None, warm: list[str],
          own_code: bool, server: ForkServer | None, alloc: Allocation | None = None):
    # Shared by every job: Hydra's loader and callbacks, the task function and Hydra's singletons
    # (ConfigStore, JobRuntime), pickled once with cloudpickle as Hydra's joblib launcher does.
    import cloudpickle
    from hydra.core.singleton import Singleton

    from expgpu.pool.loop import Pool
    from expgpu.rundir import atomic_write_bytes

    state = sweep_dir / jobfiles.STATE
    # One per launch(): a kept fork server (and its forks) hold the last one's, unpickled.
    context = state / f"pool-context-{os.getpid()}-{record.batch}.pkl"
    pool = Pool(jobs, gpus, s, sweep_dir, context, lease_dir, desc, spares, record, job_env, threads, warm,
                own_code, server, server is not None and primable(*shared, own_code), alloc)
    try:
        atomic_write_bytes(context, cloudpickle.dumps((*shared, Singleton.get_state())))
        # the forks to come find it unpickled (spares.task_modules: why not always)
        if own_code and server is not None and server.alive():
            server.warm([], context)
    except BaseException:
        close_pool(pool)
        raise
    return pool


def close_pool(pool) -> None:
    """After the pool's last job: its spares go, the context file too, the fork server is kept for
    the next launch() of this sweep."""
    thaw()   # the batch's configs (compose.settle): collectable again once nothing holds them
    for spare in pool.spares:
        spare.dismiss()
    pool.context.unlink(missing_ok=True)
    for server in (pool.node_servers or {}).values():
        server.close()
    if pool.server is None:   # inside an allocation: no fork server
        return _tidy(pool.sweep_dir / jobfiles.STATE)
    _keep(pool.server, pool.sweep_dir / jobfiles.STATE, bool(pool.gpus))


# This process's fork server, kept from one launch() to the next of the same sweep: an optimizing
# sweeper calls launch() once per batch of trials (Optuna: n_jobs at a time), and a new server
# would import torch again for every batch (seconds each; Hydra's basic launcher pays it once).
_kept: dict[tuple[Path, bool], ForkServer] = {}
_made: set[Path] = set()   # sweep dirs start_server_ahead made


def _server(state: Path, hide_gpus: bool, warm: list[str]) -> ForkServer:
    server = _kept.pop((state, hide_gpus), None)
    for key in list(_kept):   # another sweep's (a second sweep in one process): done with
        _close(_kept.pop(key), key[0])
    if server is not None and server.alive():
        server.warm(warm)   # what it has already is not imported again
        return server
    if server is not None:
        _close(server, state)
        state.mkdir(parents=True, exist_ok=True)   # _close tidied it away
    return ForkServer(state / SPARES_LOG, spare_env(hide_gpus), warm)


def _keep(server: ForkServer, state: Path, hide_gpus: bool) -> None:
    """After a launch(): keep the server for the next one (closed when this process exits)."""
    if not server.alive():
        return _close(server, state)
    atexit.unregister(_close_kept)   # once, however many launch() calls
    atexit.register(_close_kept)
    _kept[(state, hide_gpus)] = server


def _close_kept() -> None:
    while _kept:
        (state, _), server = _kept.popitem()
        _close(server, state)
    while _made:   # a sweep that ended before its first launch() (a bad override) leaves no empty dir
        sweep_dir = _made.pop()
        try:
            sweep_dir.rmdir()
        except OSError:   # something is in it: the sweep's
            pass


def _close(server: ForkServer, state: Path) -> None:
    server.close()   # after the jobs: its forks die with it
    _tidy(state)


def _tidy(state: Path) -> None:
    """Leave the sweep's .expgpu/ only if a spare process had something to say."""
    log_file = state / SPARES_LOG
    try:
        if log_file.exists() and log_file.stat().st_size == 0:
            log_file.unlink()
        state.rmdir()
    except OSError:
        pass
