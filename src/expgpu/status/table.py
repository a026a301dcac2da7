"""The rows as text: a plain aligned table (what a terminal, a pipe and a log show alike), the notes below it."""

from __future__ import annotations

import os
from pathlib import Path

from expgpu.status.read import RunRow

METRICS_SHOWN = 3   # the first few values of a row: the table stays one line a run


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def number(x: float) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def step(row: RunRow) -> str:
    if row.kind == "sweep":
        return f"{sum((row.jobs or {}).values())} jobs"
    if row.kind == "allocation":   # a slurm_pool sweep's, while SLURM queues it
        return f"SLURM job {row.slurm_job}"
    if row.step is None:
        return "-"
    if row.max_steps:
        return f"{row.step}/{row.max_steps} ({100 * row.step // row.max_steps} %)"
    return str(row.step)


def metrics(row: RunRow) -> str:
    if row.kind == "sweep":   # its jobs by status; its best value so far
        counts = ", ".join(f"{n} {s}" for s, n in sorted((row.jobs or {}).items(), key=lambda kv: -kv[1]))
        return counts + "".join(f"; best {k} {number(v)}" for k, v in row.metrics.items())
    if row.kind == "allocation":
        return row.note
    shown = [f"{k} {number(v)}" for k, v in list(row.metrics.items())[:METRICS_SHOWN]]
    return "  ".join(shown) or "-"


def where(path: str, cwd: Path | None = None) -> str:
    """A dir as the user would type it: relative to the current dir when it is below it."""
    cwd = cwd or Path(os.getcwd())
    try:
        return str(Path(path).relative_to(cwd))
    except ValueError:
        return path


HEAD = ("STATUS", "STEP", "METRICS", "GPUS", "ELAPSED", "ETA", "DIR")


def table(rows: list[RunRow]) -> str:
    lines = [HEAD]
    for r in rows:
        status = f"sweep: {r.status}" if r.kind == "sweep" else r.status
        lines.append((status, step(r), metrics(r), r.gpus or "-", duration(r.elapsed_s),
                      duration(r.eta_s) if r.eta_s is not None else "-", where(r.dir)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEAD))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text += [f"  {where(r.dir)}: {r.note}" for r in rows if r.note and r.status != "queued" and r.kind != "allocation"]
    return "\n".join(text)
