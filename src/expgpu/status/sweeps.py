"""The runs and sweeps under a directory, and a sweep's jobs: where `expgpu status` finds what to show.

A dir is a sweep's or a run's by what it holds (expgpu.report.collect's marks: the report finds job dirs the same
way); the walk goes no deeper than either, nor into hidden dirs, nor more than DEPTH levels below the top
(outputs/DATE/TIME, outputs/multirun/DATE/TIME, outputs/slurm/JOB). A sweep's jobs are its job dirs, gpu_pool's jobs
that have none yet (pool.json), SLURM jobs submitted for it that have not started (.submitit/<job id>/), and a
slurm_pool sweep's allocation while SLURM queues it (.slurm_pool/job.json).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

from expgpu import rundir
from expgpu.report import CSV_FILE
from expgpu.report.collect import is_job_dir, is_sweep_dir, job_dirs
from expgpu.report.table import best_in_csv
from expgpu.results import allocation_job
from expgpu.rundir import POOL_RECORD, STUDY
from expgpu.status import queue
from expgpu.status.read import QUEUED_STATES, RunRow, read_run, settle
from expgpu.status.table import number

DEPTH = 4
# Which status a sweep row shows, from its jobs': the first that any job has (a search whose trials finished
# or were pruned or diverged is finished; one whose every trial was pruned, pruned)
_SWEEP_ORDER = ("running", "queued", "waiting", "lost", "failed", "hung", "broken", "stopped", "finished", "diverged",
                "pruned")


def find(top: Path) -> tuple[list[Path], list[Path]]:
    """The run dirs and the sweep dirs under `top` (`top` itself, if it is one)."""
    runs: list[Path] = []
    sweeps: list[Path] = []
    for root, dirs, files in os.walk(top):
        names = dirs + files
        path = Path(root)
        if is_sweep_dir(names):
            sweeps.append(path)
            dirs[:] = []
        elif is_job_dir(names):
            runs.append(path)
            dirs[:] = []
        else:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            if len(path.relative_to(top).parts) >= DEPTH:
                dirs[:] = []
    return runs, sweeps


def _pool(sweep: Path) -> tuple[list[dict], str]:
    """pool.json's jobs, and why its queued jobs wait (GPUs leased or in use elsewhere; "" when they do not)."""
    try:
        doc = json.loads((sweep / POOL_RECORD).read_bytes())
    except (OSError, ValueError):
        return [], ""
    if not isinstance(doc, dict):
        return [], ""
    jobs, waiting = doc.get("jobs"), doc.get("waiting")
    return ([j for j in jobs if isinstance(j, dict)] if isinstance(jobs, list) else [],
            waiting if isinstance(waiting, str) else "")


def _submitted(sweep: Path) -> list[str]:
    """The SLURM job ids submitit recorded for this sweep (its folder's subdirs, as %j names them)."""
    try:
        return [e.name for e in os.scandir(sweep / ".submitit") if e.is_dir() and e.name.replace("_", "").isdigit()]
    except OSError:
        return []


def _allocation_row(sweep: Path, job: str, state: str | None, jobs: list[RunRow]) -> RunRow | None:
    """A slurm_pool sweep's allocation as a row while SLURM queues it (pending, or requeued), or while it runs and
    no job of it has started yet: the rest of the time its jobs tell."""
    if state is None or (state not in QUEUED_STATES and jobs):
        return None
    return RunRow(kind="allocation", dir=str(sweep / rundir.SLURM_POOL), slurm_job=job,
                  status="queued" if state in QUEUED_STATES else "running",
                  note=f"the sweep's allocation: {state.lower()}", started=rundir.mtime(sweep))


def _study(sweep: Path) -> tuple[list[str], list[str], dict[Path, dict]]:
    """An optimizing sweeper's objective names, directions and trials by job dir, from its study.json
    (expgpu_optuna's, rewritten at most once a second while trials run): ([], [], {}) for any other sweep."""
    try:
        doc = json.loads((sweep / STUDY).read_bytes())
        objective = [str(name) for name in doc["objective"]]
        directions = [str(way) for way in doc.get("directions") or []]
        trials = {Path(str(t["job_dir"])).resolve(): t for t in doc["trials"]
                  if isinstance(t, dict) and t.get("job_dir")}
    except (OSError, ValueError, KeyError, TypeError):
        return [], [], {}
    return objective, directions, trials


# A sweep's best value so far ({name: value}, or {}) and the dir of the job that has it (None: no job named)
Best = tuple[dict[str, float], Path | None]


def _best(objective: list[str], directions: list[str], trials: dict[Path, dict]) -> Best:
    """A single-objective search's best value so far, over its completed trials ({} before one, and for several
    objectives, which have no single best): what its sweep's row shows."""
    done = [(t["values"][0], path) for path, t in trials.items() if t.get("state") == "COMPLETE"
            and isinstance(t.get("values"), list) and t["values"] and isinstance(t["values"][0], (int, float))]
    if len(objective) != 1 or not done:
        return {}, None
    pick = max if directions[:1] == ["maximize"] else min
    value, path = pick(done, key=lambda vp: vp[0])
    return {objective[0]: value}, path


def _reported_best(sweep: Path) -> Best:
    """Any other sweep's best so far, by the sweep report's rule (expgpu.report.best), as its report.csv marks it
    (rewritten as jobs end while the sweep runs). {} without a report, or before a job has the metric."""
    found = best_in_csv(sweep / CSV_FILE)
    if found is None:
        return {}, None
    metric, value, where = found
    return {metric: value}, where.resolve() if where is not None else None


def _mark_best(jobs: list[RunRow], best: Best) -> None:
    """In a sweep's own listing, the job with its best value says so (a line under the table)."""
    values, where = best
    if not values or where is None:
        return
    row = next((r for r in jobs if Path(r.dir).resolve() == where), None)
    if row is not None and not row.note:
        row.note = "the sweep's best so far: " + ", ".join(f"{k} {number(v)}" for k, v in values.items())


def _objective_first(row: RunRow, objective: list[str], trial: dict | None) -> None:
    """A trial's row leads with the search's objective: the value it was judged by. Its last row of metrics.jsonl
    may not hold it (a running trial between evaluations): the latest value it reported to the study then."""
    last = trial.get("last_value") if trial else None
    if len(objective) == 1 and objective[0] not in row.metrics and isinstance(last, (int, float)):
        row.metrics[objective[0]] = last
    first = {k: row.metrics[k] for k in objective if k in row.metrics}
    row.metrics = {**first, **{k: v for k, v in row.metrics.items() if k not in first}}


def sweep_jobs(sweep: Path, now: float, study: tuple) -> tuple[list[RunRow], list[str]]:
    """A sweep's jobs' rows, and the SLURM job ids submitted for it with no run dir yet (squeue decides those);
    `study`: its _study()."""
    rows = [read_run(path, now) for _, path in job_dirs(sweep)]
    objective, _, trials = study
    for row in rows:
        row.kind = "job"
        if objective:
            _objective_first(row, objective, trials.get(Path(row.dir).resolve()))
    seen = {Path(r.dir).resolve() for r in rows}
    entries, why = _pool(sweep)
    for entry in entries:
        job_dir = Path(str(entry.get("dir", "")))
        job_dir = job_dir if job_dir.is_absolute() else sweep / job_dir
        gpus = entry.get("gpus") or []
        shown = f"GPU {','.join(map(str, gpus))}" if gpus else \
            f"cpu slot {entry['slot']}" if entry.get("slot") is not None else ""
        mine = next((r for r in rows if Path(r.dir).resolve() == job_dir.resolve()), None)
        if mine is not None:
            mine.gpus = mine.gpus or shown
            if mine.status in ("lost", "running") and entry.get("state") in ("failed", "stopped"):
                mine.status, mine.note = entry["state"], entry.get("error") or mine.note
            elif mine.pid is None and mine.status in ("lost", "running") and entry.get("state") == "queued":
                mine.status = "waiting"   # its job dir made ahead (a primed job), its GPUs still busy
        elif job_dir.resolve() not in seen and entry.get("state") in ("queued", "not_started"):
            rows.append(RunRow(kind="job", dir=str(job_dir), gpus=shown,
                               status="waiting" if entry["state"] == "queued" else "not started"))
    waiting = [r for r in rows if r.status == "waiting"]
    if why and waiting:   # said once, by the first of them (the next to start)
        waiting[0].note = why
    started = {r.slurm_job for r in rows if r.slurm_job}
    return rows, [j for j in _submitted(sweep) if j not in started]


def sweep_row(sweep: Path, jobs: list[RunRow], best: dict[str, float] | None = None) -> RunRow:
    """A sweep as one row: its jobs by status, the most pressing of them (or of its allocation's) as its own;
    `best`: its best value so far (_best, _reported_best)."""
    counts = Counter(r.status for r in jobs if r.kind != "allocation")
    every = Counter(r.status for r in jobs)
    status = next((s for s in _SWEEP_ORDER if every.get(s)), next(iter(every), "empty"))
    status, ended = (None if jobs else _before_any_job(sweep)) or (status, "")
    starts = [r.started for r in jobs if r.started]
    running = [r for r in jobs if r.status == "running"]
    etas = [r.eta_s for r in running if r.eta_s is not None]
    started = min(starts) if starts else rundir.mtime(sweep)
    elapsed = [r.elapsed_s + (r.started - started) for r in jobs if r.elapsed_s is not None and r.started]
    gpus = ", ".join(dict.fromkeys(r.gpus for r in running if r.gpus))
    why = next((r.note for r in jobs if r.status == "waiting" and r.note), ended)   # pool.json's: the same for all
    return RunRow(kind="sweep", dir=str(sweep), status=status, jobs=dict(sorted(counts.items())), note=why,
                  started=started, elapsed_s=round(max(elapsed), 1) if elapsed else None,
                  eta_s=max(etas) if etas and not counts.get("queued") and not counts.get("waiting") else None,
                  gpus=gpus, metrics=dict(best or {}))


def _before_any_job(sweep: Path) -> tuple[str, str] | None:
    """(status, note) of a sweep with no job yet, from its own records: refused (the user error that ended it,
    expgpu.errors.said), starting (its process lives), or ended (its process gone); None where it cannot tell."""
    from expgpu.results import read_job_failure, read_process
    from expgpu.status.read import lives

    failure = read_job_failure(sweep)
    if failure:
        return "failed", " ".join(str(failure["message"]).split())
    record = read_process(sweep) or {}
    here = lives(record) if record else None
    if here is None:
        return None
    return ("starting", "") if here else ("lost", f"its process ({record.get('pid')}) ended before any job started")


def rows(top: Path, expand: bool | None = None, now: float | None = None) -> list[RunRow]:
    """The table's rows under `top`, newest first: a sweep as one row, or, when `top` is a sweep (or `expand`),
    its jobs. squeue is asked once, for every run's SLURM job that its files cannot tell apart."""
    now = time.time() if now is None else now
    runs, sweeps = find(top)
    expand = expand if expand is not None else sweeps == [top]
    out = [read_run(p, now) for p in runs]
    by_sweep: list[tuple[Path, list[RunRow]]] = []
    unstarted: dict[str, Path] = {}
    allocations = {sweep: job for sweep in sweeps if (job := allocation_job(sweep))}
    bests: dict[Path, Best] = {}
    for sweep in sweeps:
        study = _study(sweep)
        # a search's from its study (for several objectives, none: no single best), else the report's
        bests[sweep] = _best(*study) if study[0] else _reported_best(sweep)
        jobs, waiting = sweep_jobs(sweep, now, study)
        by_sweep.append((sweep, jobs))
        unstarted.update({j: sweep for j in waiting})
    every = out + [r for _, jobs in by_sweep for r in jobs]
    wondering = [r.slurm_job for r in every if r.slurm_job and r.status in ("running", "lost", "failed")]
    asked = wondering + list(unstarted) + list(allocations.values())
    answer = queue.states(asked) if asked else {}
    for r in every:
        settle(r, answer)
    for job, sweep in unstarted.items():
        state = (answer or {}).get(job)
        if state is None and answer is not None:
            continue   # left the queue without a run dir: a job its dirs or the sweep's log tell about
        jobs = next(js for s, js in by_sweep if s == sweep)
        jobs.append(RunRow(kind="job", dir=str(sweep / ".submitit" / job), slurm_job=job,
                           status="queued" if state in QUEUED_STATES else "running" if state else "submitted",
                           note=f"SLURM job {job}: " + (state.lower() if state else "squeue not available")))
    for sweep, jobs in by_sweep:
        if sweep in allocations:
            row = _allocation_row(sweep, allocations[sweep], (answer or {}).get(allocations[sweep]), jobs)
            jobs += [row] if row else []
        if expand:
            _mark_best(jobs, bests[sweep])   # after settle(), which may set a row's note
            out += jobs or [sweep_row(sweep, jobs, bests[sweep][0])]   # none yet: the sweep itself, empty
        else:
            out.append(sweep_row(sweep, jobs, bests[sweep][0]))
    return sorted(out, key=lambda r: -(r.started or 0.0))
