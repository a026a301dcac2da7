"""A sweep's jobs as the pool sees them, and the files they leave: the job file a job's process
reads, the JobReturn it sends back, and pool.json in the sweep dir (every job of every launch()
batch: GPUs, times, outcome; expgpu.report reads it)."""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from expgpu import results
from expgpu.errors import UserError, WorkerFailed, one_line
from expgpu.pool.job_config import job_dir
from expgpu.pool.sharing import is_share, shown, which
from expgpu.procs import oom
from expgpu.rundir import CONSOLE, STATE
from expgpu.rundir import POOL_JOB as JOB_FILE
from expgpu.rundir import POOL_RECORD as RECORD
from expgpu.rundir import POOL_RETURN as RETURN_FILE


class JobFailed(WorkerFailed):
    """What a failed job's JobReturn raises: which job, its error in one line, where its output is.

    A WorkerFailed (a sweep's job is its worker), which the CLI shows as one line,
    `expgpu: job #3 (...) failed: ...`, with exit code 1."""

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.failure = None
        self.reported = False   # the launcher's summary named it already (the CLI says less)


@dataclass
class Job:
    num: int
    overrides: list[str]
    config: Any                  # the job's composed config (DictConfig, hydra node included)
    dir: Path
    need: int                    # GPUs; 0 takes a CPU slot
    nodes: int = 1               # inside a SLURM allocation: the nodes its GPUs are spread over
    state: str = "queued"        # queued | running | ending | finished | failed | stopped | not_started
    gpus: list = field(default_factory=list)
    slot: int | None = None
    proc: Any = None             # its subprocess.Popen
    exit_fd: int | None = None   # readable once proc has exited (a pidfd), None where unsupported
    started: float | None = None
    ended: float | None = None
    returncode: int | None = None
    error: str | None = None
    ret: Any = None              # its hydra.core.utils.JobReturn
    primed: bool = False         # its process did Hydra's set-up of it before its start (Spare.prime)
    kept: bool = False           # finished in an earlier run of this sweep dir: not started (expgpu.pool.kept)
    timed_out: str | None = None   # why the launcher stopped it (past hydra.launcher.timeout_min), if it did
    kill_at: float | None = None   # then: when SIGKILL follows (time.monotonic())
    oom_count: oom.OomCount | None = None   # its process's memory cgroup's OOM kills from its start (expgpu.procs.oom)
    sent_kill: bool = False      # the launcher sent it SIGKILL (a stop or a time limit, past the grace)

    @property
    def label(self) -> str:
        shown = [o for o in self.overrides if not o.lstrip("+~").startswith("hydra.")]
        return " ".join(shown) or "(no overrides)"

    @property
    def where(self) -> str:
        if self.gpus and hasattr(self.gpus[0], "node"):   # an allocation's: SLURM picks the node's GPUs
            nodes = list(dict.fromkeys(g.node for g in self.gpus))
            if self.gpus[0].cpu:
                return (f"{nodes[0]}: CPU slot {self.gpus[0].index}" if len(nodes) == 1
                        else f"{','.join(nodes)}: a CPU slot each")
            per = len(self.gpus) // len(nodes)
            return (f"{','.join(nodes)}: {per} GPU{'s' if per > 1 else ''}" + (" each" if len(nodes) > 1 else "")
                    + which(self.gpus))
        if self.gpus:
            return shown(self.gpus)   # GPU 0,1; a share of them: GPU 0 (share 2 of 4)
        return f"cpu slot {self.slot}" if self.slot is not None else "-"

    def close_exit_fd(self) -> None:
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None

    def failure(self) -> str:
        console = self.dir / CONSOLE
        return f"job #{self.num} ({self.label}) {self.state}: {self.error}" + (
            f"; its output: {console}" if console.exists() else "")


def compose(ctx, master, overrides: Sequence[str], num: int, need) -> Job:
    """The job's config as Hydra's own launchers compose it; `need(cfg)`: the GPUs it needs."""
    from omegaconf import open_dict

    from expgpu.pool.compose import sweep_config

    cfg = sweep_config(ctx.config_loader, master, overrides)
    with open_dict(cfg):
        cfg.hydra.job.id = num
        cfg.hydra.job.num = num
    return Job(num, list(overrides), cfg, job_dir(cfg), need(cfg))


def write_job_file(job: Job, context: Path) -> Path:
    """What the job's process needs that its spare did not have: the launcher's sys.path, the shared
    context file (Hydra's context, the task function, Hydra's singletons) and the job's config."""
    import cloudpickle

    state = job.dir / STATE
    state.mkdir(parents=True, exist_ok=True)
    (state / RETURN_FILE).unlink(missing_ok=True)
    path = state / JOB_FILE
    replace(path, pickle.dumps(list(sys.path)) + cloudpickle.dumps(
        {"context": str(context), "config": job.config, "return": str(state / RETURN_FILE)}))
    return path


def replace(path: Path, data: bytes) -> None:
    """Whole or absent (write, rename), without fsync: for a file read within the second and
    deleted, where an fsync would only delay the next job's start (or end)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def job_return(job: Job, code: int | None, stop_signal: int | None, spares_log: Path):
    """The JobReturn the job sent back; one made here when it sent none (killed, crashed). A job the
    launcher stopped at its time limit failed, whatever it did on the signal (saved and stopped, died)."""
    ret = _job_return(job, code, stop_signal, spares_log)
    if job.timed_out is None or job.state == "finished":   # finished as its limit came: finished
        return ret
    from hydra.core.utils import JobStatus

    job.state, job.error = "failed", f"{job.timed_out} ({job.error})" if job.error else job.timed_out
    ret.status, ret.return_value = JobStatus.FAILED, JobFailed(job.failure())
    return _quiet(ret)


def _job_return(job: Job, code: int | None, stop_signal: int | None, spares_log: Path):
    from hydra.core.utils import JobStatus

    ret, outcome = None, None
    path = job.dir / STATE / RETURN_FILE
    if path.exists():
        try:
            ret, outcome = pickle.loads(path.read_bytes())
        except Exception as e:   # a class of the job's the launcher cannot import, a torn file
            job.error = f"its JobReturn could not be read: {one_line(e)}"
        path.unlink(missing_ok=True)
    (job.dir / STATE / JOB_FILE).unlink(missing_ok=True)
    if ret is None:
        return _quiet(_made_up_return(job, code, stop_signal, spares_log))
    job.state = outcome["state"]
    job.error = outcome.get("error")
    if ret.status is JobStatus.FAILED and not isinstance(ret._return_value, UserError):
        cause = ret._return_value
        ret.return_value = JobFailed(job.failure())
        ret._return_value.__cause__ = cause if isinstance(cause, BaseException) else None
    return _quiet(ret)


def _quiet(ret):
    """A JobReturn whose return_value raises a failed job's error without Hydra's own "Error executing
    job with overrides: [...]" on stderr: the pool's summary names every failed job once, better."""
    from hydra.core.utils import JobStatus

    if ret.status is JobStatus.FAILED:
        ret.__class__ = _quiet_class()
    return ret


@functools.cache
def _quiet_class() -> type:
    from hydra.core.utils import JobReturn, JobStatus

    class ReportedJobReturn(JobReturn):
        @property
        def return_value(self) -> Any:
            if self.status is not JobStatus.FAILED:
                return self._return_value
            raise self._return_value

        @return_value.setter
        def return_value(self, value: Any) -> None:
            self._return_value = value

    return ReportedJobReturn


def _made_up_return(job: Job, code: int | None, stop_signal: int | None, spares_log: Path):
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf, open_dict

    ret = JobReturn(overrides=job.overrides, working_dir=os.getcwd(), status=JobStatus.FAILED)
    ret.cfg = copy.deepcopy(job.config)
    with open_dict(ret.cfg):
        del ret.cfg["hydra"]
    ret.hydra_cfg = OmegaConf.create({"hydra": job.config.hydra})
    if job.error is None:
        if code is not None and code < 0:
            job.error = results.killed_by(code) if job.sent_kill else oom.killed_by(code, job.oom_count)
        elif stop_signal is not None:
            job.error = f"stopped by {signal.Signals(stop_signal).name} (exit code {code})"
        else:
            job.error = f"exited with code {code}" + (last_line(job.dir / CONSOLE) or last_line(spares_log))
    job.state = "stopped" if stop_signal is not None and job.state == "ending" else "failed"
    ret.return_value = JobFailed(job.failure())
    return ret


def last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f" ({' '.join(lines[-1].split())[:300]})" if lines else ""


# Rows of the launch() batches that ended in this process, by sweep dir: an optimizing sweeper
# (Optuna with max_batch_size=1) calls launch() once per trial, and pool.json keeps them all.
_earlier: dict[str, list[dict]] = {}


class Record:
    """pool.json: every job of every launch() batch of this sweep, in launch order."""

    def __init__(self, sweep_dir: Path, pool_gpus: list, cpu_slots: int, threads: str, simulated: bool,
                 allocation: dict | None = None, jobs_per_gpu: int = 1):
        self.path = sweep_dir / RECORD
        self.before = _earlier.setdefault(str(sweep_dir), [])
        if not self.before:   # a rerun of the sweep dir (a requeued allocation): its earlier jobs stay listed
            self.before.extend(_rows(self.path))
        self.head = {"launcher": "gpu_pool", "pool": [g.index for g in pool_gpus], "cpu_slots": cpu_slots,
                     "threads_per_job": threads}
        if allocation is not None:   # inside a SLURM allocation: its job id, nodes and their GPUs
            self.head["allocation"] = allocation
        if jobs_per_gpu > 1:   # each GPU shared by that many jobs (expgpu.pool.sharing)
            self.head["jobs_per_gpu"] = jobs_per_gpu
        self.simulated = simulated
        self.batch = len({r["batch"] for r in self.before})   # this launch()'s number, from 0

    def write(self, jobs: list[Job], stop_signal: int | None, waiting: str = "") -> None:
        """`waiting`: why queued jobs wait now (the board's line: GPUs leased or in use elsewhere), for
        expgpu status; "" when they do not."""
        from expgpu.rundir import atomic_write_bytes

        rows = _replaced(self.before, [self._row(j) for j in jobs])
        doc = {**self.head, "batches": self._batches(rows),
               "interrupted": signal.Signals(stop_signal).name if stop_signal else None,
               **({"waiting": waiting} if waiting else {}), "jobs": rows}
        atomic_write_bytes(self.path, (json.dumps(doc, indent=1) + "\n").encode())

    def close(self, jobs: list[Job]) -> None:
        """This batch is over: the next launch() in this process adds its jobs after these."""
        self.before[:] = _replaced(self.before, [self._row(j) for j in jobs])

    def _row(self, j: Job) -> dict:
        return {
            "num": j.num, "overrides": j.overrides, "dir": str(j.dir), "state": j.state,
            "gpus": [g.index for g in j.gpus], "gpu_names": [g.name for g in j.gpus],
            **({"shares": [g.share for g in j.gpus]} if j.gpus and is_share(j.gpus[0]) else {}),
            "simulated": self.simulated, "slot": j.slot,
            "need": j.need, "nodes": sorted({g.node for g in j.gpus if hasattr(g, "node")}),
            "pid": j.proc.pid if j.proc else None, "started": j.started, "ended": j.ended,
            "wall_s": round(j.ended - j.started, 3) if j.started and j.ended else None,
            "returncode": j.returncode, "error": j.error, "batch": self.batch, "primed": j.primed, "kept": j.kept,
        }

    @staticmethod
    def _batches(rows: list[dict]) -> list[dict]:
        """One entry per launch(): its number and its jobs' numbers."""
        out: dict[int, list[int]] = {}
        for r in rows:
            out.setdefault(r["batch"], []).append(r["num"])
        return [{"batch": b, "jobs": nums} for b, nums in sorted(out.items())]


def _rows(path: Path) -> list[dict]:
    """The jobs an earlier run of the sweep wrote to its pool.json (none if it is missing or unreadable)."""
    try:
        jobs = json.loads(path.read_text()).get("jobs")
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in jobs if isinstance(r, dict) and "num" in r and "batch" in r] if isinstance(jobs, list) else []


def _replaced(before: list[dict], rows: list[dict]) -> list[dict]:
    """`before`, less the jobs that `rows` ran again (a rerun's row is the job's latest), then `rows`."""
    again = {r["num"] for r in rows}
    return [r for r in before if r["num"] not in again] + rows
