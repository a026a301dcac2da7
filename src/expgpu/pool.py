"""The gpu_pool launcher's work: run a Hydra sweep's jobs in parallel, each on GPUs of its own.

    launch()  compose every job's config (Hydra's load_sweep_config), work out the GPUs it needs,
              then loop: reap finished jobs, lease free GPUs, start what fits (Scheduler), show it.

Each job runs in a process of its own (expgpu.pool_job), started ahead of time and warmed up (it
imports Hydra while other jobs run) but given nothing of its job, and no GPU, until its GPUs are
leased: then it gets its environment (CUDA_VISIBLE_DEVICES: its GPUs' NVML indices, with
CUDA_DEVICE_ORDER=PCI_BUS_ID) before any of the job's code runs, so nothing in it can touch
another job's GPU. Inside, expgpu's usual line runs on that mask (the inventory is narrowed to the
leased GPUs). GPUs are leased machine-wide (expgpu.leases): the job's process holds the lock, so a
GPU frees itself when its job ends, however it ends, and two sweeps never share a GPU.

Jobs run in their own process group (session), so a Ctrl-C at the terminal reaches only the
launcher, which passes it on to every running job (expgpu checkpoints and stops), waits grace_s,
then SIGKILLs what is left; queued jobs never start. Jobs die with the launcher (PR_SET_PDEATHSIG).

Nothing here is imported at Hydra start-up; the plugin imports it inside launch().
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from expgpu import pool_job
from expgpu.app import WorkerFailed
from expgpu.errors import UserError

log = logging.getLogger("expgpu.pool")

POLL_S = 0.02               # how often the launcher looks at its jobs and the free GPUs (at the
                            # latest: it wakes at once when a job's process exits)
CONSOLE = "console.log"     # a job's stdout and stderr, in its job dir
RECORD = "pool.json"        # in the sweep dir: every job's GPUs, times and outcome (expgpu.report reads it)
_STATE = ".expgpu"          # in a job dir: the job file and the returned JobReturn (removed after)
_JOB_FILE, _RETURN_FILE = "pool-job.pkl", "pool-return.pkl"


# ---------------------------------------------------------------------------------------------
# Settings (hydra.launcher.*)

@dataclass(frozen=True)
class Settings:
    gpus: tuple[int, ...] | None     # None: all
    gpus_per_job: int | None
    max_parallel: int | None
    cpu_slots: int
    lease_dir: str | None
    wait_timeout_s: float | None
    grace_s: float


def settings(params: Mapping[str, Any]) -> Settings:
    from omegaconf import OmegaConf

    p = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
         for k, v in params.items()}

    def whole(key: str, low: int, none_ok: bool) -> int | None:
        value = p.get(key)
        if value is None and none_ok:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            allowed = f"an integer >= {low}" + (" or null" if none_ok else "")
            raise UserError(f"hydra.launcher.{key}={value!r} is not allowed: {allowed}")
        return value

    def seconds(key: str, none_ok: bool) -> float | None:
        value = p.get(key)
        if value is None and none_ok:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                or not math.isfinite(value):
            raise UserError(f"hydra.launcher.{key}={value!r} is not allowed: seconds >= 0"
                            + (" or null" if none_ok else ""))
        return float(value)

    gpus = p.get("gpus", "all")
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        gpus = [gpus]
    if gpus == "all" or gpus is None:
        chosen = None
    elif isinstance(gpus, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        if len(set(gpus)) != len(gpus):
            raise UserError(f"hydra.launcher.gpus={gpus}: a GPU is listed twice; list each once")
        chosen = tuple(gpus)
    else:
        raise UserError(f"hydra.launcher.gpus={gpus!r} is not allowed: all, or a list of GPU indices "
                        "as nvidia-smi numbers them, e.g. [0,2]")
    lease = p.get("lease_dir")
    if lease is not None and not (isinstance(lease, str) and lease.strip()):
        raise UserError(f"hydra.launcher.lease_dir={lease!r} is not allowed: a directory path or null")
    return Settings(gpus=chosen, gpus_per_job=whole("gpus_per_job", 0, True),
                    max_parallel=whole("max_parallel", 1, True), cpu_slots=whole("cpu_slots", 1, False),
                    lease_dir=lease, wait_timeout_s=seconds("wait_timeout_s", True),
                    grace_s=seconds("grace_s", False))


def pool_gpus(s: Settings, simulate: Any = None) -> list:
    """The GPUs this sweep may lease: the inventory (NVML, or simulated), narrowed by an inherited
    CUDA_VISIBLE_DEVICES, then by hydra.launcher.gpus."""
    from expgpu.gpus import inventory

    visible = inventory(simulate)
    if s.gpus is None:
        return visible
    by_index = {g.index: g for g in visible}
    for i in s.gpus:
        if i not in by_index:
            seen = ", ".join(str(g) for g in sorted(by_index)) or "none"
            mask = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = f" (CUDA_VISIBLE_DEVICES={mask!r} hides the others)" if mask is not None else ""
            raise UserError(f"hydra.launcher.gpus: GPU {i} is not on this machine; allowed: all, or "
                            f"a list of {seen}{why}")
    return [by_index[i] for i in s.gpus]


# ---------------------------------------------------------------------------------------------
# Scheduling (pure: no processes, no locks)

class Scheduler:
    """Which waiting jobs start now, given the free GPUs and CPU slots.

    Jobs start in sweep order. A job that needs more GPUs than are free is passed by later jobs
    that fit (no GPU idles while a job could use it), but only `patience` times: after that, GPUs
    that free up are kept for it, so a 2-GPU job is never starved by a stream of 1-GPU jobs, and
    since a job never holds some GPUs while waiting for more, mixed sizes cannot deadlock.
    """

    def __init__(self, patience: int):
        self.patience = max(1, patience)
        self.head: Any = None     # the oldest job that did not fit
        self.passed = 0           # how many jobs started ahead of it

    def pick(self, waiting: Sequence[tuple[Any, int]], free_gpus: Sequence[Any], free_slots: Sequence[int],
             room: float) -> list[tuple[Any, tuple, int | None]]:
        """waiting: (job, GPUs needed; 0 = a CPU slot) in sweep order. Returns (job, its GPUs, its
        CPU slot or None) for every job to start now."""
        gpus, slots = list(free_gpus), list(free_slots)
        starts: list[tuple[Any, tuple, int | None]] = []
        blocked = None
        for job, need in waiting:
            if room <= 0:
                break
            if need == 0:
                if slots:
                    starts.append((job, (), slots.pop(0)))
                    room -= 1
                continue
            if blocked is not None and self.passed >= self.patience:
                continue   # keep what frees up for the blocked job
            if need <= len(gpus):
                starts.append((job, tuple(gpus[:need]), None))
                del gpus[:need]
                room -= 1
                if blocked is not None:
                    self.passed += 1
            elif blocked is None:
                blocked = job
                if job != self.head:
                    self.head, self.passed = job, 0
        if blocked is None:
            self.head, self.passed = None, 0
        return starts


# ---------------------------------------------------------------------------------------------
# Jobs

class JobFailed(WorkerFailed):
    """What a failed job's JobReturn raises: which job, its error in one line, where its output is.

    A WorkerFailed (a sweep's job is its worker), which the CLI shows as one line,
    `expgpu: job #3 (...) failed: ...`, with exit code 1."""

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.failure = None

    def __reduce__(self):
        return (type(self), (str(self),))


@dataclass
class Job:
    num: int
    overrides: list[str]
    config: Any                  # the job's composed config (DictConfig, hydra node included)
    dir: Path
    need: int                    # GPUs; 0 takes a CPU slot
    state: str = "queued"        # queued | running | finished | failed | stopped | not_started
    gpus: list = field(default_factory=list)
    slot: int | None = None
    proc: subprocess.Popen | None = None
    exit_fd: int | None = None   # readable once proc has exited (a pidfd), None where unsupported
    started: float | None = None
    ended: float | None = None
    returncode: int | None = None
    error: str | None = None
    ret: Any = None              # its hydra.core.utils.JobReturn

    @property
    def label(self) -> str:
        shown = [o for o in self.overrides if not o.startswith("hydra.")]
        return " ".join(shown) or "(no overrides)"

    @property
    def where(self) -> str:
        if self.gpus:
            return "GPU " + ",".join(str(g.index) for g in self.gpus)
        return f"cpu slot {self.slot}" if self.slot is not None else "-"


def job_need(cfg: Any, s: Settings, pool_size: int) -> int:
    """GPUs a job needs: hydra.launcher.gpus_per_job, else what its expgpu config asks for."""
    from omegaconf import OmegaConf

    if pool_size == 0:
        return 0
    if s.gpus_per_job is not None:
        return s.gpus_per_job
    nproc = OmegaConf.select(cfg, "launch.nproc_per_node", default=None)
    per_rank = OmegaConf.select(cfg, "gpu_map.gpus_per_rank", default=None)
    if nproc is None and per_rank is None:
        return 1   # not an expgpu app: one GPU per job
    nproc, per_rank = int(nproc or 1), int(per_rank or 1)
    # share: ranks take turns on the GPUs they are given, so a job can run on one rank's worth
    return per_rank if OmegaConf.select(cfg, "gpu_map.share", default=False) else nproc * per_rank


def _compose(ctx, master, overrides: Sequence[str], num: int, s: Settings, pool_size: int) -> Job:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    cfg = ctx.config_loader.load_sweep_config(master, list(overrides))
    with open_dict(cfg):
        cfg.hydra.job.id = num
        cfg.hydra.job.num = num
    # The job dir as run_job will compute it (a subdir like ${hydra:job.override_dirname} reads
    # HydraConfig), so the launcher knows where the job's console.log goes.
    hc = HydraConfig.instance()
    saved = hc.cfg
    hc.set_config(cfg)
    try:
        job_dir = Path(str(OmegaConf.select(cfg, "hydra.sweep.dir"))) / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
    finally:
        hc.cfg = saved
    return Job(num, list(overrides), cfg, job_dir, job_need(cfg, s, pool_size))


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# ---------------------------------------------------------------------------------------------
# The live view: a table on a terminal, a log line per event otherwise

class Board:
    def __init__(self, jobs: list[Job], pool_desc: str):
        self.jobs, self.pool_desc = jobs, pool_desc
        self.note = ""
        self.live = None
        self.was_live = False
        self._shown = 0.0
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            # No refresh thread (auto_refresh=False): the launcher starts jobs with fork+exec,
            # and a second thread holding a lock at fork time is how children deadlock.
            self.live = Live(self._render(), console=Console(stderr=True), auto_refresh=False,
                             redirect_stdout=False, redirect_stderr=False, transient=False)
            self.live.start()

    def counts(self) -> str:
        by = {s: sum(j.state == s for j in self.jobs) for s in
              ("queued", "running", "ending", "finished", "failed", "stopped", "not_started")}
        by["running"] += by["ending"]
        done = by["finished"] + by["failed"] + by["stopped"]
        text = f"done {done}/{len(self.jobs)}"
        bad = [f"{by[s]} {s}" for s in ("failed", "stopped") if by[s]]
        if bad:
            text += f" ({', '.join(bad)})"
        text += f", running {by['running']}, queued {by['queued']}"
        return text + (f", not started {by['not_started']}" if by["not_started"] else "")

    def _render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts = [Text(f"gpu_pool on {self.pool_desc}: {self.counts()}", style="bold")]
        now = time.time()
        shown = [j for j in self.jobs if j.state in ("running", "failed", "stopped")]
        shown += [j for j in self.jobs if j.state == "queued"][:3]
        if shown:
            table = Table(box=None, pad_edge=False)
            for col in ("job", "on", "state", "time", "overrides"):
                table.add_column(col, no_wrap=col != "overrides")
            for j in sorted(shown, key=lambda j: j.num):
                took = (j.ended or now) - j.started if j.started else None
                style = {"failed": "red", "stopped": "yellow", "queued": "dim"}.get(j.state, "")
                table.add_row(f"#{j.num}", j.where if j.state != "queued" else "-", j.state,
                              f"{took:.0f}s" if took is not None else "", j.label, style=style)
            parts.append(table)
        if self.note:
            parts.append(Text(self.note, style="italic"))
        return Group(*parts)

    def event(self, text: str) -> None:
        if self.live is None:
            log.info("%s  [%s]", text, self.counts())
        self.tick(force=True)

    def waiting(self, text: str) -> None:
        if text != self.note:
            self.note = text
            if text and self.live is None:
                log.info("%s", text)
            self.tick(force=True)

    def tick(self, force: bool = False) -> None:
        if self.live is not None and (force or time.monotonic() - self._shown > 0.5):
            self.live.update(self._render(), refresh=True)
            self._shown = time.monotonic()

    def close(self) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.stop()   # draws the final table once more, and leaves it on the screen
            self.live = None
            self.was_live = True


# ---------------------------------------------------------------------------------------------
# The launcher side

def launch(params: Mapping[str, Any], hydra_context, task_function, config,
           job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    from hydra.core.singleton import Singleton
    from hydra.core.utils import configure_log, setup_globals
    from omegaconf import OmegaConf

    from expgpu import leases

    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    s = settings(params)
    simulate = OmegaConf.select(config, "inventory.simulate", default=None)
    if OmegaConf.is_config(simulate):
        simulate = OmegaConf.to_container(simulate, resolve=True)
    gpus = pool_gpus(s, simulate)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    state = sweep_dir / _STATE
    state.mkdir(parents=True, exist_ok=True)
    lease_dir = leases.lease_dir(s.lease_dir) if gpus else None
    # The first wave's processes warm up while the jobs' configs are composed.
    first_wave = min(len(job_overrides), len(gpus) or s.cpu_slots, s.max_parallel or math.inf)
    spares = [pool_job.Spare(state, hide_gpus=bool(gpus)) for _ in range(first_wave)]
    try:
        jobs = [_compose(hydra_context, config, o, initial_job_idx + i, s, len(gpus))
                for i, o in enumerate(job_overrides)]
        for job in jobs:
            if job.need > len(gpus):
                how = ("hydra.launcher.gpus_per_job" if s.gpus_per_job is not None
                       else "launch.nproc_per_node x gpu_map.gpus_per_rank")
                raise UserError(f"job #{job.num} ({job.label}) needs {job.need} GPUs ({how}), but the pool has "
                                f"{len(gpus)} ({', '.join(str(g.index) for g in gpus)}); ask for fewer per job, "
                                "or set hydra.launcher.gpus")
    except BaseException:
        for spare in spares:
            spare.dismiss()
        _tidy(state)
        raise

    if gpus:
        desc = f"GPU {','.join(str(g.index) for g in gpus)}" + (" (simulated)" if simulate is not None else "")
    else:
        desc = f"{s.cpu_slots} CPU slot{'s' if s.cpu_slots > 1 else ''}"
    log.info("gpu_pool: %d jobs on %s; sweep dir %s", len(jobs), desc, sweep_dir)
    for job in jobs:
        log.info("\t#%d : %s", job.num, job.label)

    # Shared by every job: Hydra's loader and callbacks, the task function and Hydra's singletons
    # (ConfigStore, JobRuntime), pickled once with cloudpickle as Hydra's joblib launcher does.
    import cloudpickle

    context = state / f"pool-context-{os.getpid()}.pkl"
    pool = Pool(jobs, gpus, s, sweep_dir, context, lease_dir, desc, spares, simulated=simulate is not None)
    try:
        _write(context, cloudpickle.dumps((hydra_context, task_function, Singleton.get_state())))
        pool.run()
    finally:
        for spare in pool.spares:
            spare.dismiss()
        context.unlink(missing_ok=True)
        _tidy(state)
    pool.summary()
    if pool.stop_signal is not None:
        raise KeyboardInterrupt
    return [job.ret for job in jobs]


def _tidy(state: Path) -> None:
    """Leave the sweep's .expgpu/ only if a spare process had something to say."""
    log_file = state / pool_job.SPARES_LOG
    try:
        if log_file.exists() and log_file.stat().st_size == 0:
            log_file.unlink()
        state.rmdir()
    except OSError:
        pass


def _write(path: Path, data: bytes) -> None:
    from expgpu.rundir import atomic_write_bytes

    atomic_write_bytes(path, data)


def _exit_fd(pid: int) -> int | None:
    """A descriptor that becomes readable when process `pid` exits (Linux >= 5.3), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _close_exit_fd(job: Job) -> None:
    if job.exit_fd is not None:
        os.close(job.exit_fd)
        job.exit_fd = None


def _replace(path: Path, data: bytes) -> None:
    """Whole or absent (write, rename), without fsync: for a file read within the second and
    deleted, where an fsync would only delay the next job's start."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Pool:
    """The launcher's loop over its jobs' processes, the free GPUs and the signals it receives."""

    def __init__(self, jobs: list[Job], gpus: list, s: Settings, sweep_dir: Path, context: Path,
                 lease_dir: Path | None, desc: str, spares: list[pool_job.Spare], simulated: bool = False):
        self.jobs, self.gpus, self.s = jobs, gpus, s
        self.sweep_dir, self.context, self.lease_dir = sweep_dir, context, lease_dir
        self.scheduler = Scheduler(patience=max(1, len(gpus)))
        self.board: Board | None = None
        self.desc = desc
        self.simulated = simulated and bool(gpus)
        self.stop_signal: int | None = None
        self._hard = False
        self._kill_at: float | None = None
        self._waiting_since: float | None = None
        self._busy_elsewhere: tuple = ()
        self.spares = spares   # processes started ahead of their jobs
        self._dirty = False    # pool.json is behind
        self._spares_broken = False   # a spare died before it got a job: stop starting them ahead
        self.capacity = int(min(len(gpus) + (s.cpu_slots if not gpus or any(j.need == 0 for j in jobs) else 0),
                                s.max_parallel or math.inf))

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        self._record()
        self.board = Board(self.jobs, self.desc)
        old = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: signals stay with whoever handles them
            pass
        from expgpu import stopping

        early = stopping.current() and stopping.current().received
        if early:  # a Ctrl-C while Hydra composed the sweep: the CLI's Stopper kept it for us
            self.stop_signal = signal.Signals[early]
        try:
            while True:
                ended = self._reap()
                if self.stop_signal is not None:
                    self._stopping()
                elif any(j.state == "queued" for j in self.jobs):
                    self._start_ready()
                    self._check_waiting()
                self._settle(ended)
                self._keep_spares()
                if self._dirty:   # once per round, after the starts: not on a job's critical path
                    self._record()
                if not any(j.state in ("queued", "running") for j in self.jobs):
                    break
                self.board.tick()
                self._idle(POLL_S)
        finally:
            for job in self._running():  # an error in this loop: nothing outlives the launcher
                self._kill(job)
                job.proc.wait()
            for job in self.jobs:
                _close_exit_fd(job)
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self.board.close()
            self._record()

    def _running(self) -> list[Job]:
        return [j for j in self.jobs if j.state == "running"]

    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self._hard = True   # a second Ctrl-C: kill now

    def _stopping(self) -> None:
        if self._kill_at is None:
            for job in self.jobs:
                if job.state == "queued":
                    job.state = "not_started"
            name = signal.Signals(self.stop_signal).name
            for job in self._running():
                _signal_group(job.proc.pid, self.stop_signal)
            self._kill_at = time.monotonic() + self.s.grace_s
            self.board.event(f"{name}: stopping {len(self._running())} running job(s) "
                             f"(SIGKILL in {self.s.grace_s:.0f}s, again to kill now)")
            self._dirty = True
        if self._hard or time.monotonic() > self._kill_at:
            for job in self._running():
                self._kill(job)

    # -- starting -----------------------------------------------------------------------------
    def _start_ready(self) -> None:
        from expgpu import leases

        running = self._running()
        room = (self.s.max_parallel or math.inf) - len(running)
        self._busy_elsewhere = ()
        if room <= 0:
            return
        waiting = [(j.num, j.need) for j in self.jobs if j.state == "queued"]
        held: dict[int, Any] = {}
        if self.gpus and any(need for _, need in waiting):
            ours = {g.index for j in running for g in j.gpus}
            candidates = [g for g in self.gpus if g.index not in ours]
            held = {lease.gpu.index: lease for lease in leases.acquire_free(self.lease_dir, candidates)}
            self._busy_elsewhere = tuple(g for g in candidates if g.index not in held)
        try:
            used = {j.slot for j in running}
            slots = [i for i in range(self.s.cpu_slots) if i not in used]
            by_num = {j.num: j for j in self.jobs}
            for num, indices, slot in self.scheduler.pick(waiting, list(held), slots, room):
                self._start(by_num[num], [held.pop(i) for i in indices], slot)
        finally:
            leases.release_all(list(held.values()))

    def _keep_spares(self) -> None:
        """Warm processes for the jobs to come: as many as could start at once, one warming at a time
        (so they do not slow the running jobs' own start-up)."""
        for spare in [sp for sp in self.spares if not sp.alive()]:
            self.spares.remove(spare)
            spare.dismiss()
            self._spares_broken = True
        queued = sum(j.state == "queued" for j in self.jobs) if self.stop_signal is None else 0
        want = 0 if self._spares_broken else min(queued, self.capacity)
        while len(self.spares) > want:
            self.spares.pop().dismiss()
        if len(self.spares) < want and all(sp.is_ready() for sp in self.spares):
            self.spares.append(pool_job.Spare(self.sweep_dir / _STATE, hide_gpus=bool(self.gpus)))

    def _process(self) -> pool_job.Spare:
        """A process for the next job: a warmed-up one if there is one."""
        alive = [sp for sp in self.spares if sp.alive()]
        pick = next((sp for sp in alive if sp.is_ready()), alive[0] if alive else None)
        if pick is not None:
            self.spares.remove(pick)
            return pick
        return pool_job.Spare(self.sweep_dir / _STATE, hide_gpus=bool(self.gpus))

    def _start(self, job: Job, job_leases: list, slot: int | None) -> None:
        import cloudpickle

        from expgpu import leases

        gpus = [lease.gpu for lease in job_leases]
        env = {"EXPGPU_POOL_JOB": str(job.num), "EXPGPU_POOL_GPUS": ",".join(str(g.index) for g in gpus)}
        if slot is not None:
            env["EXPGPU_POOL_SLOT"] = str(slot)
        if self.gpus:  # a machine with GPUs: a job sees its own and no other (none for a CPU job)
            order = os.environ.get("CUDA_DEVICE_ORDER")
            if order in (None, "PCI_BUS_ID"):
                env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"   # CUDA numbers GPUs as NVML / nvidia-smi do
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus)
            else:  # the user's order is kept; UUIDs name the right GPUs whatever the order
                env["CUDA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in gpus)
        spare = None
        try:
            state = job.dir / _STATE
            state.mkdir(parents=True, exist_ok=True)
            (state / _RETURN_FILE).unlink(missing_ok=True)
            job_file = state / _JOB_FILE
            _replace(job_file, pickle.dumps(list(sys.path)) + cloudpickle.dumps(
                {"context": str(self.context), "config": job.config, "return": str(state / _RETURN_FILE)}))
            spare = self._process()
            for lease in job_leases:
                lease.note(pid=spare.proc.pid, sweep=str(self.sweep_dir), job=job.num)
            spare.give({"job_file": str(job_file), "console": str(job.dir / CONSOLE), "env": env},
                       [lease.fd for lease in job_leases])
        except OSError as e:
            leases.release_all(job_leases)
            job.state = "failed"
            job.error = f"could not start: {_one_line(e)}" + (_last_line(spare.log) if spare else "")
            if spare is not None:
                spare.dismiss()
            job.ret = self._job_return(job, None)
            self.board.event(f"#{job.num} failed to start: {job.error}")
            self._dirty = True
            return
        job.proc = spare.proc
        job.exit_fd = _exit_fd(job.proc.pid)
        for lease in job_leases:  # the job's process holds the lease from now on
            lease.handed_over()
        job.state, job.gpus, job.slot, job.started = "running", gpus, slot, time.time()
        self._waiting_since = None
        self.board.event(f"#{job.num} started on {job.where}: {job.label}")
        self._dirty = True

    def _check_waiting(self) -> None:
        """Say who holds the GPUs queued jobs wait for; give up after wait_timeout_s."""
        from expgpu import leases

        queued = [j for j in self.jobs if j.state == "queued" and j.need > 0]
        # The lock said busy a moment ago; the file says by whom (read, not locked: no churn).
        # A job of ours that just ended may hold its lease a moment longer: that is no news.
        holders = [(g, leases.noted(self.lease_dir, g)) for g in self._busy_elsewhere]
        holders = [(g, h) for g, h in holders if h.get("sweep") != str(self.sweep_dir)]
        if not queued or not holders:
            self.board.waiting("")
            self._waiting_since = None
            return
        who = "; ".join(f"GPU {g.index}: {leases.describe_holder(h or {'pid': '?'})}" for g, h in holders[:4])
        self.board.waiting(f"waiting for GPUs leased by others ({who})")
        if self._running() or self.s.wait_timeout_s is None:
            self._waiting_since = None
            return
        now = time.monotonic()
        self._waiting_since = self._waiting_since or now
        if now - self._waiting_since > self.s.wait_timeout_s:
            for job in queued:
                job.state = "failed"
                job.error = (f"no GPU within hydra.launcher.wait_timeout_s={self.s.wait_timeout_s:g}s; "
                             f"leased by others: {who}")
                job.ret = self._job_return(job, None)
            self.board.event(f"gave up on {len(queued)} queued job(s) after {self.s.wait_timeout_s:g}s")
            self._dirty = True

    # -- ending -------------------------------------------------------------------------------
    def _reap(self) -> list[Job]:
        """Jobs whose process has just exited: their GPUs and slots are free from now on."""
        ended = []
        for job in self._running():
            code = job.proc.poll()
            if code is None:
                continue
            # The job is over: whatever it left running in its group (a forked loader worker
            # holding the lease descriptor) goes too, so its GPUs free up now.
            _signal_group(job.proc.pid, signal.SIGKILL)
            _close_exit_fd(job)
            job.ended, job.returncode, job.state = time.time(), code, "ending"
            ended.append(job)
        return ended

    def _settle(self, ended: list[Job]) -> None:
        """Read what the ended jobs sent back (after the next jobs have started: not on their path)."""
        for job in ended:
            job.ret = self._job_return(job, job.returncode)
            took = job.ended - job.started
            if job.state == "finished":
                self.board.event(f"#{job.num} finished in {took:.1f}s on {job.where}")
            else:
                self.board.event(f"#{job.num} {job.state} after {took:.1f}s on {job.where}: {job.error}")
            self._dirty = True

    def _idle(self, timeout: float) -> None:
        """Wait until a running job's process exits or `timeout` passes: a slot is refilled the
        moment its job ends, not up to a poll interval later (a wave of 1-s jobs loses ~1%)."""
        fds = [j.exit_fd for j in self._running() if j.exit_fd is not None]
        if fds:
            select.select(fds, [], [], timeout)
        else:
            time.sleep(timeout)

    def _kill(self, job: Job) -> None:
        _signal_group(job.proc.pid, signal.SIGKILL)

    def _job_return(self, job: Job, code: int | None):
        """The JobReturn the job sent back; one made here when it sent none (killed, crashed)."""
        from hydra.core.utils import JobReturn, JobStatus
        from omegaconf import OmegaConf, open_dict

        ret, outcome = None, None
        path = job.dir / _STATE / _RETURN_FILE
        if path.exists():
            try:
                ret, outcome = pickle.loads(path.read_bytes())
            except Exception as e:   # a class of the job's the launcher cannot import, a torn file
                job.error = f"its JobReturn could not be read: {_one_line(e)}"
            path.unlink(missing_ok=True)
        (job.dir / _STATE / _JOB_FILE).unlink(missing_ok=True)
        if ret is None:
            ret = JobReturn(overrides=job.overrides, working_dir=os.getcwd(), status=JobStatus.FAILED)
            ret.cfg = copy.deepcopy(job.config)
            with open_dict(ret.cfg):
                del ret.cfg["hydra"]
            ret.hydra_cfg = OmegaConf.create({"hydra": job.config.hydra})
            if job.error is None:
                if code is not None and code < 0:
                    job.error = f"killed by {signal.Signals(-code).name}"
                elif self.stop_signal is not None:
                    job.error = f"stopped by {signal.Signals(self.stop_signal).name} (exit code {code})"
                else:
                    spares_log = self.sweep_dir / _STATE / pool_job.SPARES_LOG
                    job.error = f"exited with code {code}" + (_last_line(job.dir / CONSOLE) or _last_line(spares_log))
            job.state = "stopped" if self.stop_signal is not None and job.state == "ending" else "failed"
            ret.return_value = JobFailed(self._failure(job))
            return ret
        job.state = outcome["state"]
        job.error = outcome.get("error")
        if ret.status is JobStatus.FAILED and not isinstance(ret._return_value, UserError):
            cause = ret._return_value
            ret.return_value = JobFailed(self._failure(job))
            ret._return_value.__cause__ = cause if isinstance(cause, BaseException) else None
        return ret

    def _failure(self, job: Job) -> str:
        console = job.dir / CONSOLE
        return f"job #{job.num} ({job.label}) {job.state}: {job.error}" + (
            f"; its output: {console}" if console.exists() else "")

    def _record(self) -> None:
        self._dirty = False
        rows = []
        for j in self.jobs:
            rows.append({
                "num": j.num, "overrides": j.overrides, "dir": str(j.dir), "state": j.state,
                "gpus": [g.index for g in j.gpus], "gpu_names": [g.name for g in j.gpus],
                "simulated": self.simulated, "slot": j.slot,
                "need": j.need, "pid": j.proc.pid if j.proc else None, "started": j.started, "ended": j.ended,
                "wall_s": round(j.ended - j.started, 3) if j.started and j.ended else None,
                "returncode": j.returncode, "error": j.error,
            })
        doc = {"launcher": "gpu_pool", "pool": [g.index for g in self.gpus], "cpu_slots": self.s.cpu_slots,
               "interrupted": signal.Signals(self.stop_signal).name if self.stop_signal else None, "jobs": rows}
        _write(self.sweep_dir / RECORD, (json.dumps(doc, indent=1) + "\n").encode())

    def summary(self) -> None:
        bad = [j for j in self.jobs if j.state in ("failed", "stopped")]
        if self.board is not None and not self.board.was_live:   # else the table says it already
            log.info("gpu_pool: %s", self.board.counts())
        for j in bad:
            log.error("%s", self._failure(j))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)   # the job leads its own session: its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f" ({' '.join(lines[-1].split())[:300]})" if lines else ""
