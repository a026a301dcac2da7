"""One run dir, as `expgpu status` shows it: where it is (status, step of total, ETA), read from the few small
files it holds, cheaply enough for a thousand of them in well under a second.

It reads result.json (a finished run's status, metrics, GPUs and times), only the tail of metrics.jsonl (the last
row's step, progress fields and values: a seek to its end, never the whole file), and the process record
(.expgpu/process.json, expgpu.results.write_process): a run without result.json is `running` while the process in
charge of it lives (this host: its pid, with the same start time; another host: its files changed lately), `lost`
when it does not (killed, its node gone) and `failed` when it left a failure record. A SLURM job that has not
started (or was requeued) is `queued`: squeue's answer is handed in (expgpu.status.queue), asked once for all runs.
A file that is torn or unreadable makes the row say so; the other rows are unharmed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from expgpu import rundir
from expgpu.loggers.progress import DATA_WARN, FIELDS
from expgpu.report.collect import Row as ReportRow
from expgpu.report.collect import devices, failure_line

TAIL_BYTES = 8192     # the last rows of metrics.jsonl: a row is a few hundred bytes
STALE_S = 600.0       # a run on another host whose files have not changed in this long is lost
_BOOKKEEPING = ("step", "epoch", "time", *FIELDS)   # a row's own fields, not what the task logged
_HOST = socket.gethostname()


@dataclass
class RunRow:
    """One line of the table (and one object of --json)."""
    kind: str                         # run, sweep, job (a SLURM job of a sweep without a run dir yet), or
    #                                   allocation (a slurm_pool sweep's, while SLURM queues it)
    dir: str
    status: str = "unknown"           # running, finished, failed, stopped, pruned, diverged, hung, lost, queued, ...
    step: int | None = None
    max_steps: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)   # the last logged values (result.json's at the end)
    gpus: str = ""
    started: float | None = None      # when the run began (epoch seconds)
    elapsed_s: float | None = None
    eta_s: float | None = None
    data_wait: float | None = None    # a running run's share of its last 30 s spent waiting for batches
    note: str = ""                    # why a run failed or was lost, a torn file
    jobs: dict[str, int] | None = None   # a sweep's: its jobs by status
    host: str | None = None
    pid: int | None = None
    slurm_job: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _json(path: Path, row: RunRow) -> dict | None:
    """A small JSON file's object; None when absent; a torn or unreadable one is said in the row."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        row.note = row.note or f"{path.name} unreadable: {e.strerror}"
        return None
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        return doc
    except ValueError as e:
        row.note = row.note or f"{path.name} unreadable (torn?): {' '.join(str(e).split())[:120]}"
        return None


def last_row(path: Path, row: RunRow) -> tuple[dict | None, float | None]:
    """metrics.jsonl's last whole row, from its tail only, and the file's mtime (None, None: no file)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            tail = b""
            for span in (TAIL_BYTES, 16 * TAIL_BYTES):
                f.seek(max(0, size - span))
                tail = f.read(span)
                lines = tail.split(b"\n")
                if size > span:
                    lines = lines[1:]   # the first line of a tail is cut
                found, torn = None, False
                for i, line in enumerate(reversed(lines)):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                            found = rec
                            break
                    except ValueError:
                        pass
                    torn = True
                if torn:
                    row.note = row.note or "metrics.jsonl: its last line is torn (shown: the row before)"
                if found is not None or size <= span:
                    return found, st.st_mtime
            return None, st.st_mtime
    except FileNotFoundError:
        return None, None
    except OSError as e:
        row.note = row.note or f"metrics.jsonl unreadable: {e.strerror}"
        return None, None


def _numbers(values: dict) -> dict[str, float]:
    return {str(k): v for k, v in values.items()
            if k not in _BOOKKEEPING and isinstance(v, (int, float)) and not isinstance(v, bool)}


def alive(record: dict, newest: float | None, now: float) -> bool:
    """Whether the process in charge of a run still runs: on this host its pid (lives); on another, whether its
    files changed in the last STALE_S."""
    here = lives(record)
    if here is not None:
        return here
    return newest is not None and now - newest < STALE_S


def lives(record: dict) -> bool | None:
    """Whether the process a record names still runs: on this host by its pid with the same start time (a pid is
    reused), a zombie being gone; None on another host, where this process cannot tell."""
    if record.get("host") != _HOST or not isinstance(record.get("pid"), int):
        return None
    import psutil

    try:
        proc = psutil.Process(record["pid"])
        same = abs(proc.create_time() - float(record.get("created") or 0)) < 1.0
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError, TypeError):
        return False


def slurm_job_of(run_dir: Path, record: dict | None) -> str | None:
    """The SLURM job of a run: its record's, else the name of a dir under outputs/slurm/ (rundir's layout)."""
    if record and record.get("job"):
        return str(record["job"])
    if run_dir.parent.name == "slurm" and run_dir.name.replace("_", "").isdigit():
        return run_dir.name
    return None


def read_run(run_dir: Path, now: float | None = None) -> RunRow:
    """What the run dir says by itself; `settle` decides an unfinished run's status (squeue's answer in hand)."""
    now = time.time() if now is None else now
    row = RunRow(kind="run", dir=str(run_dir))
    result_path = run_dir / rundir.RESULT
    result = _json(result_path, row)
    last, metrics_mtime = last_row(run_dir / rundir.METRICS, row)
    record = _json(rundir.process_file(run_dir), row) or {}
    row.host = record.get("host")
    row.pid = record.get("pid") if isinstance(record.get("pid"), int) else None
    row.started = _number(record.get("started"))
    if last is not None:
        row.step = last["step"]
        row.max_steps = last.get("max_steps") if isinstance(last.get("max_steps"), int) else None
        row.metrics = _numbers(last)
    if result is not None:
        row.status = str(result.get("status", "unknown"))
        row.step = result.get("steps") if isinstance(result.get("steps"), int) else row.step
        if isinstance(result.get("max_steps"), int):
            row.max_steps = result["max_steps"]
        if isinstance(result.get("metrics"), dict) and result["metrics"]:
            row.metrics = _numbers(result["metrics"])
        row.gpus = devices(result, simulated=False)
        timing = result.get("timing") if isinstance(result.get("timing"), dict) else {}
        train_s = _number(timing.get("train_s"))
        if train_s is not None:
            row.elapsed_s = round((_number(timing.get("startup_s")) or 0.0) + train_s, 1)
        if row.status in ("failed", "hung"):
            line = (result.get("hang") or {}).get("line") if isinstance(result.get("hang"), dict) else None
            row.note = row.note or line or _failure(run_dir) or ""
        if row.started is None:
            row.started = rundir.mtime(result_path) - (row.elapsed_s or 0.0)
        return row
    if row.note.startswith(rundir.RESULT):   # there, but torn or unreadable (its note says which)
        row.status = "broken"
    row.slurm_job = slurm_job_of(run_dir, record)
    row.gpus = _visible(run_dir, record)
    if row.started is None:
        row.started = rundir.mtime(run_dir / ".hydra") or rundir.mtime(run_dir)
    seen = (metrics_mtime, rundir.mtime(rundir.process_file(run_dir)), rundir.mtime(run_dir))
    newest = max((t for t in seen if t), default=0.0)
    job_failed = _failure(run_dir) if rundir.job_failure_file(run_dir).exists() else None
    if job_failed:   # the job's own record: failed, even while its process lives on (a sweep's next job)
        row.status, row.note = "failed", job_failed
    elif row.status != "broken":
        if record and alive(record, newest, now):
            row.status = "running"
        elif not record and not (run_dir / rundir.METRICS).exists() and (run_dir / rundir.PLAN).exists():
            row.status = "dry run"
        elif not record and now - newest < STALE_S:
            row.status = "running"   # a run from before process records, or one that is just starting
        else:
            reason = _failure(run_dir)
            row.status, row.note = ("failed", reason) if reason else ("lost", _lost(record))
    if row.status == "running":
        row.elapsed_s = round(now - row.started, 1) if row.started else None
        eta = _number(last.get("eta_s")) if last else None
        if eta is not None:
            row.eta_s = round(max(0.0, eta - max(0.0, now - (_number(last.get("time")) or now))), 1)
        row.data_wait = _number(last.get("data_wait")) if last else None
        if row.data_wait is not None and row.data_wait >= DATA_WARN:   # in a sweep: which jobs starve
            row.note = row.note or (f"waited for batches {100 * row.data_wait:.0f}% of its last 30 s: the data, "
                                    "not the model, sets its pace")
    elif row.started:
        row.elapsed_s = round(max(0.0, newest - row.started), 1)
    return row


def settle(row: RunRow, queue: dict[str, str] | None) -> None:
    """A SLURM run's status from squeue's answer (job id -> state; None: squeue could not be asked): pending or
    requeued is `queued`, running is `running` (whatever its files say, they may be on another host's clock)."""
    if row.slurm_job is None or queue is None or row.status not in ("running", "lost", "failed"):
        return
    state = queue.get(row.slurm_job)
    if state in QUEUED_STATES:
        row.status, row.eta_s, row.note = "queued", None, f"SLURM job {row.slurm_job} {state.lower()}"
    elif state in RUNNING_STATES and row.status == "lost":
        row.status, row.note = "running", ""


QUEUED_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
                           "SUSPENDED"})
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"})


def _failure(run_dir: Path) -> str | None:
    return failure_line(run_dir, ReportRow(job="", dir=run_dir))


def _lost(record: dict) -> str:
    if record.get("host") == _HOST:
        return f"its process ({record.get('pid')}) is gone, without a result.json"
    if record:
        return f"no news from {record.get('host')} for over {STALE_S / 60:.0f} min, and no result.json"
    return "no result.json, and no process record"


def _visible(run_dir: Path, record: dict) -> str:
    """An unfinished run's GPUs: its plan.json's (several ranks, a dry run), else what its process saw."""
    plan = None
    try:
        plan = json.loads((run_dir / rundir.PLAN).read_bytes())
    except (OSError, ValueError):
        pass
    if isinstance(plan, dict) and isinstance(plan.get("ranks"), list):
        shown = devices({"plan": plan["ranks"]}, simulated=False)
        if shown:
            return shown
    visible = record.get("visible")
    return f"GPU {visible}" if visible else ""


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
