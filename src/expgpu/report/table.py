"""The report as text (for the terminal, best job first) and as report.csv (for a spreadsheet or
pandas: one row per job in job order, a rank column, a column per override key and per metric)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from expgpu.report.best import Ranking, metric_columns, place
from expgpu.report.collect import Row
from expgpu.rundir import STUDY


def fmt(x, digits: int = 4) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def headline(ranking: Ranking) -> str:
    """One line: the metric, which way, why that metric, and the best job (or why none is)."""
    if ranking.metric is None:
        return f"nothing to rank by: {ranking.why}"
    way = ranking.direction
    if ranking.assumed:   # a wrong guess ranks the sweep upside down: say it is one, and how to undo it
        way += ", assumed: the name says neither loss nor score, --maximize if not"
    ranked = f"ranked by {ranking.metric} ({way}; {ranking.why})"
    best = ranking.best
    if best is None:
        return f"{ranked}: no finished job returned it"
    what = " ".join(ranking.differs.get(best.job) or []) or "no overrides"
    return f"{ranked}; best: job {best.job} ({what}), {ranking.metric} {fmt(best.metrics[ranking.metric], 6)}"


def table(rows: list[Row], ranking: Ranking) -> str:
    metrics = metric_columns(rows, ranking.metric)
    head = ("rank", "job", "status", *metrics, "steps", "wall_s", "devices", "overrides")
    lines = [head]
    for r in ranking.rows:
        n = place(r, ranking)
        mark = "-" if n is None else f"{n}*" if r is ranking.best else str(n)
        lines.append((mark, r.job, r.shown_status, *(fmt(r.metrics.get(m)) for m in metrics), fmt(r.steps),
                      fmt(None if r.wall_s is None else round(r.wall_s, 1)), r.devices or "-",
                      " ".join(ranking.differs.get(r.job) or []) or "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [headline(ranking)]
    if ranking.common:
        text.append(f"every job: {' '.join(ranking.common)}")
    text += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    for r in ranking.rows:
        if r.said:
            text.append(f"  job {r.job}: {r.said}")
    if rerun(rows, ranking):
        text.append(rerun(rows, ranking))
    return "\n".join(text)


def rerun(rows: list[Row], ranking: Ranking) -> str:
    """For an optimizing sweep's report: the command that reruns its best trial alone ("" otherwise)."""
    best = ranking.best
    if best is None or best.dir is None or not (best.dir.parent / STUDY).exists():
        return ""
    return f"rerun the best (job {best.job}): {best.command()}"


def write_csv(rows: list[Row], ranking: Ranking, path: Path) -> None:
    from expgpu.rundir import atomic_write_bytes

    keys: list[str] = []
    for r in rows:
        keys += [k for k in r.settings() if k not in keys]
    metrics = metric_columns(rows, ranking.metric)
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["rank", "best", "job", *keys, "status", *metrics, "steps", "wall_s", "devices",
                "overrides", "dir", "error"])
    for r in rows:   # job order, as the jobs ran: the rank column sorts it in a spreadsheet
        s = r.settings()
        n = place(r, ranking) or ""
        w.writerow([n, "yes" if r is ranking.best else "", r.job, *(s.get(k, "") for k in keys), r.status,
                    *("" if r.metrics.get(m) is None else repr(r.metrics[m]) for m in metrics), fmt(r.steps),
                    "" if r.wall_s is None else r.wall_s, r.devices, " ".join(r.overrides), r.dir or "", r.error])
    atomic_write_bytes(path, out.getvalue().encode())


def best_in_csv(path: Path) -> tuple[str, float, Path | None] | None:
    """What write_csv wrote about the best job: (the ranking metric, the job's value of it, its dir); None without
    a best (nothing ranked yet) or a file of this layout (torn, or not the report's)."""
    try:
        with open(path, newline="") as f:
            table = csv.reader(f)
            header = next(table)
            # the ranking metric is the first metric column: the first after `status`
            at, mark, where = header.index("status") + 1, header.index("best"), header.index("dir")
            best = next((r for r in table if len(r) == len(header) and r[mark] == "yes"), None)
        if best is None or header[at] == "steps":
            return None
        return header[at], float(best[at]), Path(best[where]) if best[where] else None
    except (OSError, ValueError, StopIteration, csv.Error):
        return None
