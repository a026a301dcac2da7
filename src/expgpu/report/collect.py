"""What a sweep dir holds, job by job: one Row each, whatever launcher wrote it.

Works on any sweep dir Hydra wrote (basic launcher, gpu_pool, joblib, SLURM through submitit) and
on a single run dir. Each job dir gives its overrides (.hydra/overrides.yaml), its objective
(.hydra/config.yaml's `objective`, an optimizing sweeper's direction in .hydra/hydra.yaml), its
outcome, returned metrics and devices (result.json), why it failed (.expgpu/failure.json, else the
first rank's .expgpu/rank*.failure.json), its logged history (metrics.jsonl: every name run.log wrote);
gpu_pool's pool.json adds GPUs, wall times, errors and jobs that never started. A job dir that is
missing or broken is a row saying so, never the end of the report.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from expgpu.errors import UserError
from expgpu.loggers.progress import FIELDS
from expgpu.results import CUT_SHORT, FINAL, nonfinite_words
from expgpu.rundir import METRICS, POOL_RECORD, RESULT, STUDY, failure_files, hang_dir, job_failure_file

# Every metrics.jsonl row's own bookkeeping, not a metric the task logged: no panel of its own.
_NOT_PLOTTED = ("epoch", "time", "step", *FIELDS)   # FIELDS: a row's progress (expgpu.loggers.progress)
_READS_NUM = re.compile(r"\$\{hydra:\s*job\.num\s*\}")


@dataclass
class Row:
    job: str
    dir: Path | None
    overrides: list[str] = field(default_factory=list)
    status: str = "unknown"
    devices: str = ""
    steps: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)   # result.json's (what the task returned)
    objective: list[str] = field(default_factory=list)        # the job's `objective` key
    maximize: list[bool] | None = None                        # an optimizing sweeper's direction
    flags: list[str] = field(default_factory=list)            # Hydra flags (--config-dir), its hydra.job.num
    wall_s: float | None = None
    error: str = ""
    note: str = ""   # what a finished job's result says went wrong (a loss that became nan)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)   # metrics.jsonl, by name

    @property
    def said(self) -> str:
        """The line under the table: why a job failed, or a finished one's note."""
        return self.note if self.status in FINAL else self.error

    @property
    def shown_status(self) -> str:
        """The status as the table shows it: a pruned or diverged job with the step it stopped at (pruned@120)."""
        return f"{self.status}@{self.steps}" if self.status in CUT_SHORT and self.steps is not None else self.status

    def command(self) -> str:
        """The command that reruns this job alone: Hydra's flags the sweep was given (--config-dir), its
        overrides but Hydra's own and the sweep's (its hydra.job.num where its config reads it)."""
        import shlex

        kept = [o for o in self.overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
        return "python -m expgpu " + " ".join(shlex.quote(o) for o in self.flags + kept)

    @property
    def curve(self) -> list[tuple[int, float]]:
        return self.series.get("loss", [])

    @property
    def final_loss(self) -> float | None:
        return self.metrics.get("final_loss")

    @property
    def accuracy(self) -> float | None:
        return self.metrics.get("accuracy")

    def settings(self) -> dict[str, str]:
        out = {}
        for o in self.overrides:
            key, sep, value = o.partition("=")
            if sep:
                out[key.lstrip("+~")] = value
        return out


def shown(overrides: list[str]) -> list[str]:
    """The overrides a row shows: Hydra's own (hydra.*) left out."""
    return [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]


def _read_json(path: Path, row: Row) -> dict | None:
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        return doc
    except (OSError, ValueError) as e:
        row.status = "broken"
        row.error = f"{path.name} unreadable: {' '.join(str(e).split())[:200]}"
        return None


def _overrides(job_dir: Path, row: Row) -> list[str] | None:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None
    try:
        from omegaconf import OmegaConf

        value = OmegaConf.to_container(OmegaConf.load(path))
        return [str(v) for v in value] if isinstance(value, list) else None
    except Exception as e:
        row.error = row.error or f"overrides.yaml unreadable: {type(e).__name__}"
        return None


def _series(path: Path, row: Row) -> tuple[dict[str, list[tuple[int, float]]], float | None]:
    """Every logged number by name as (step, value) points, and the wall-clock span of
    metrics.jsonl; bad lines are skipped (and counted in the row's error)."""
    series: dict[str, list[tuple[int, float]]] = {}
    times, bad = [], 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}, None
    for line in lines:
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            bad += bool(line.strip())
            continue
        if not isinstance(rec, dict):
            continue
        for name, value in rec.items():
            if name not in _NOT_PLOTTED and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                series.setdefault(name, []).append((step, float(value)))
        if isinstance(rec.get("time"), (int, float)):
            times.append(float(rec["time"]))
    if bad and not row.error:
        row.error = f"metrics.jsonl: {bad} unreadable line(s) skipped"
    return series, (max(times) - min(times)) if len(times) > 1 else None


def _from_hydra(job_dir: Path, row: Row) -> None:
    """What the job's .hydra/ says: its `objective` (a name or a list), under an optimizing sweeper its
    direction, and the Hydra flags it was composed with."""
    try:
        from omegaconf import OmegaConf

        text = (job_dir / ".hydra" / "config.yaml").read_text()
        cfg = OmegaConf.create(text)
        obj = OmegaConf.to_container(cfg).get("objective") if OmegaConf.is_dict(cfg) else None
        row.objective = [obj] if isinstance(obj, str) else [str(o) for o in obj or []]
        hydra = OmegaConf.load(job_dir / ".hydra" / "hydra.yaml")
        direction = OmegaConf.select(hydra, "hydra.sweeper.direction", default=None)
        row.flags = _flags(hydra) + _its_number(text, hydra)
    except Exception:   # no .hydra/ (a run dir expgpu wrote by itself), or unreadable: no objective
        return
    if direction is not None:
        direction = OmegaConf.to_container(direction) if OmegaConf.is_config(direction) else direction
        ways = [direction] if isinstance(direction, str) else list(direction)
        row.maximize = [str(w).lower().endswith("maximize") for w in ways]


def _flags(hydra) -> list[str]:
    """--config-dir (the config source Hydra marks as the command line's) and --config-name when not expgpu's."""
    from omegaconf import OmegaConf

    sources = OmegaConf.select(hydra, "hydra.runtime.config_sources", default=None) or []
    flags = [w for s in sources if s.get("provider") == "command-line" and s.get("schema") == "file"
             for w in ("--config-dir", str(s.get("path")))]
    name = OmegaConf.select(hydra, "hydra.job.config_name", default=None)
    return flags + (["--config-name", str(name)] if name not in (None, "config") else [])


def _its_number(config_text: str, hydra) -> list[str]:
    """hydra.job.num=N for a job whose config reads its number (task.seed: ${hydra:job.num}): its rerun alone
    is no sweep's job, whose number Hydra would leave null."""
    from omegaconf import OmegaConf

    num = OmegaConf.select(hydra, "hydra.job.num", default=None)
    return [f"hydra.job.num={num}"] if num is not None and _READS_NUM.search(config_text) else []


def failure_line(job_dir: Path, row: Row) -> str | None:
    """Why the job failed, in one line: the job's own record, else the rank that failed first."""
    job = job_failure_file(job_dir)
    ranks = sorted(failure_files(job_dir), key=lambda p: (p.stat().st_mtime, p.name))
    for path in ([job] if job.exists() else []) + ranks:
        info = _read_json(path, row) or {}
        if info.get("message"):
            rank = f"rank {info['rank']}: " if "rank" in info and path != job else ""
            return rank + " ".join(str(info["message"]).split())
    return None


def devices(result: dict, simulated: bool) -> str:
    parts = []
    for r in result.get("plan") or []:
        if not isinstance(r, dict):
            continue
        gpus = ",".join(str(g) for g in r.get("gpus") or [])
        device = str(r.get("device", "?"))
        if gpus:
            peak = r.get("gpu_peak_reserved_mb")
            parts.append(f"GPU {gpus}" + (" (sim)" if simulated or not device.startswith("cuda") else "")
                         + (f" ({peak / 1024:.1f} GiB peak)" if peak else ""))
        else:
            parts.append(device)
    distinct = list(dict.fromkeys(parts))
    return "; ".join(distinct)


def _is_simulated(job_dir: Path) -> bool:
    cfg = job_dir / ".hydra" / "config.yaml"
    try:
        return bool(re.search(r"^\s+simulate:\s*(?!null)\S", cfg.read_text(), re.MULTILINE))
    except OSError:
        return False


def _diverged(nonfinite, status: str) -> str:
    """result.json's `nonfinite` (expgpu.loggers.nonfinite) in words; `status` diverged: the run stopped there."""
    words = nonfinite_words(nonfinite)
    if not words:
        return ""
    return f"diverged: {words}" \
        + (" (stopped there: task.on_nonfinite=stop)" if status == "diverged" else " (it trained on to its end)")


def read_job(job_dir: Path, name: str, pool: dict | None = None) -> Row:
    """Everything the report knows about one job, from its dir (and pool.json's entry)."""
    row = Row(job=name, dir=job_dir)
    pool = pool or {}
    row.overrides = shown(pool.get("overrides") or [])
    if not job_dir.is_dir():
        row.status = pool.get("state") if pool.get("state") in ("not_started", "queued") else "missing"
        row.error = pool.get("error") or ("" if row.status != "missing" else "no job dir")
        return row
    found = _overrides(job_dir, row)
    if found is not None:
        row.overrides = shown(found)
    result = _read_json(job_dir / RESULT, row)
    row.series, span = _series(job_dir / METRICS, row)
    _from_hydra(job_dir, row)
    if result is not None:
        row.status = str(result.get("status", "unknown"))
        metrics = result.get("metrics") or {}
        row.metrics = {str(k): v for k, v in metrics.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)} if isinstance(metrics, dict) else {}
        row.steps = result.get("steps")
        row.devices = devices(result, _is_simulated(job_dir))
        row.note = _diverged(result.get("nonfinite"), row.status)
        timing = result.get("timing") or {}
        if isinstance(timing.get("train_s"), (int, float)):
            row.wall_s = round(float(timing.get("startup_s") or 0) + float(timing["train_s"]), 3)
    reason = None
    if row.status == "hung":   # the watchdog's line names the rank at fault; its stacks are in hang/
        line = (result.get("hang") or {}).get("line")
        reason = f"{line} (every rank's stacks: {hang_dir(job_dir)})" if line else failure_line(job_dir, row)
        row.error = reason or ""
    elif row.status != "broken" and (result is None or row.status not in ("finished", "stopped")):
        reason = failure_line(job_dir, row)
        if reason is not None:
            row.status, row.error = "failed", reason
        elif result is None:
            row.status = "no result"
    if pool:
        # The launcher saw how each job ended, and which ones are still running or never ran.
        state = pool.get("state")
        if state in ("failed", "stopped") and row.status not in ("broken", "hung"):
            row.status = state
        elif state in ("running", "queued", "not_started") and row.status == "no result":
            row.status = state
        if reason is None:   # the job's own record says more than "exited with code 1"
            row.error = pool.get("error") or row.error
        if pool.get("wall_s") is not None:
            row.wall_s = pool["wall_s"]
        if not row.devices:
            gpus = pool.get("gpus") or []
            sim = " (sim)" if pool.get("simulated") else ""
            row.devices = (f"GPU {','.join(map(str, gpus))}{sim}" if gpus
                           else f"cpu slot {pool['slot']}" if pool.get("slot") is not None else "")
    if row.status != "finished":   # where an unfinished run got to (it is not ranked by these)
        if row.final_loss is None and row.curve:
            row.metrics["final_loss"] = row.curve[-1][1]
            row.steps = row.steps if row.steps is not None else row.curve[-1][0]
        for name in row.objective:   # a pruned trial: the value its pruner judged
            if name not in row.metrics and row.series.get(name):
                row.metrics[name] = row.series[name][-1][1]
    if row.wall_s is None and span is not None:
        row.wall_s = round(span, 3)
    return row


# What marks a dir as a job's (a run's): Hydra wrote it (.hydra/), or expgpu did
JOB_MARKS = (".hydra", RESULT, METRICS)
# What marks a dir as a sweep's: Hydra's multirun.yaml, gpu_pool's record, an optimizing sweep's study,
# submitit's folder of submitted jobs
SWEEP_MARKS = ("multirun.yaml", POOL_RECORD, STUDY, ".submitit")


def is_job_dir(names) -> bool:
    """Whether a dir holding these names is a job's (a run's) dir."""
    return any(m in names for m in JOB_MARKS)


def is_sweep_dir(names) -> bool:
    """Whether a dir holding these names is a sweep's dir (its jobs are below it)."""
    return any(m in names for m in SWEEP_MARKS)


def job_dirs(sweep: Path, depth: int = 3) -> list[tuple[str, Path]]:
    """Job dirs under a sweep dir: those Hydra wrote (.hydra/) or expgpu did (result.json), with their names
    relative to the sweep dir.

    Hydra's default subdir is the job number; a subdir pattern may nest, so look a few levels
    down, but not into hidden dirs (.submitit/, .expgpu/) or below a job dir."""
    found = []
    for root, dirs, files in os.walk(sweep):
        path = Path(root)
        rel = path.relative_to(sweep)
        if rel.parts and is_job_dir(dirs + files):
            found.append((str(rel), path))
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if len(rel.parts) >= depth:
            dirs[:] = []
    return sorted(found)


def collect(sweep: Path, read=read_job) -> list[Row]:
    """Every job's Row; `read` reads one job (read_job, or the live report's cached read_job)."""
    if not sweep.is_dir():
        raise UserError(f"{sweep}: no such directory; give a sweep dir such as outputs/multirun/DATE/TIME")
    pool_doc = None
    pool_path = sweep / POOL_RECORD
    if pool_path.exists():
        try:
            pool_doc = json.loads(pool_path.read_text())
        except (OSError, ValueError):
            pool_doc = None
    rows: list[Row] = []
    if pool_doc and isinstance(pool_doc.get("jobs"), list):
        seen = set()
        for entry in pool_doc["jobs"]:
            job_dir = Path(entry.get("dir", ""))
            if not job_dir.is_absolute():
                job_dir = sweep / job_dir
            # A sweep dir moved since: the job dir is where it was, relative to the sweep dir.
            if not job_dir.exists() and (sweep / job_dir.name).exists():
                job_dir = sweep / job_dir.name
            rows.append(read(job_dir, str(entry.get("num", job_dir.name)), entry))
            seen.add(job_dir.resolve())
        rows += [read(p, n) for n, p in job_dirs(sweep) if p.resolve() not in seen]
        return rows
    jobs = job_dirs(sweep)
    if not jobs and ((sweep / ".hydra").is_dir() or (sweep / RESULT).exists()):
        return [read(sweep, sweep.name)]   # a single run dir
    if not jobs:
        raise UserError(f"{sweep}: no job dirs in it (a job dir holds .hydra/ or result.json); "
                        "give a sweep dir such as outputs/multirun/DATE/TIME")
    rows = [read(p, n) for n, p in jobs]
    # Numbered job dirs (Hydra's default subdir): a gap is a job that left nothing behind.
    nums = sorted(int(n) for n, _ in jobs if n.isdigit())
    if nums:
        for gap in sorted(set(range(nums[-1] + 1)) - set(nums)):
            rows.append(read(sweep / str(gap), str(gap)))
    return sorted(rows, key=lambda r: (0, int(r.job)) if r.job.isdigit() else (1, r.job))
