"""Where a sweep stands, for the top of report.html: running (N of M jobs done) or over (finished, failed,
stopped), when the page was written, and how a running page keeps itself fresh (its reload and staleness).

Pure functions of the rows and the plan (expgpu.report.plan): the live report (expgpu.report.live) and the
sweep-end report (expgpu.report.callback) both build the page's line here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from expgpu.report.collect import Row, shown

# A job not yet over: on its way (queued: no dir yet; running: a dir, no result yet)
NOT_OVER = ("queued", "running")


@dataclass(frozen=True)
class Progress:
    state: str                  # running | finished | failed | stopped
    done: int                   # jobs over, whatever their outcome
    total: int                  # jobs planned (or seen, if more)
    running: int
    queued: int
    written: float              # time.time() of this write
    reload_s: int | None = None   # a running page reloads itself this often
    stale_s: float | None = None  # a running page older than this says its sweep may be gone


def settle(rows: list[Row], plan: list[list[str]] | int | None, running: bool) -> list[Row]:
    """The rows as the page shows them. While the sweep runs, a job dir without a result is a running job
    (not "no result"), and a job of the plan without a dir is queued; once it is over, a planned job that
    never got a dir did not start."""
    out = []
    for r in rows:
        if running and r.status in ("no result", "missing", "not_started"):
            r = dataclasses.replace(r, status="running" if r.dir is not None and r.dir.is_dir() else "queued",
                                    error="" if r.status == "missing" else r.error)
        out.append(r)
    if isinstance(plan, list):
        names = {r.job for r in out}
        for i, overrides in enumerate(plan):
            if str(i) not in names:
                out.append(Row(job=str(i), dir=None, overrides=shown(overrides),
                               status="queued" if running else "not_started"))
        out.sort(key=lambda r: (0, int(r.job)) if r.job.isdigit() else (1, r.job))
    return out


def progress(rows: list[Row], plan: list[list[str]] | int | None, state: str, written: float,
             reload_s: int | None = None, stale_s: float | None = None) -> Progress:
    running = sum(r.status == "running" for r in rows)
    queued = sum(r.status == "queued" for r in rows)
    done = sum(r.status not in (*NOT_OVER, "not_started") for r in rows)
    total = max(len(rows), plan if isinstance(plan, int) else len(plan or []))
    if isinstance(plan, int) and state == "running":   # trials the sweeper has not asked for yet
        queued = max(queued, total - done - running)
    return Progress(state, done, total, running, queued, written, reload_s, stale_s)


def over(rows: list[Row], finished: bool) -> str:
    """How a sweep that is no longer running ended: finished (Hydra's multirun end), else stopped (a
    job stopped, or never started after a stop) or failed."""
    if finished:
        return "finished"
    return "stopped" if any(r.status in ("stopped", "not_started") for r in rows) else "failed"
