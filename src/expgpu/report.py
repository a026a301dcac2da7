"""`python -m expgpu.report SWEEP_DIR`: one row per job of a sweep, report.csv and the loss curves.

    python -m expgpu.report outputs/multirun/2025-01-31/12-00-00

Works on any sweep dir Hydra wrote (basic launcher, gpu_pool, SLURM through submitit) and on a
single run dir. Each job dir gives its overrides (.hydra/overrides.yaml), its outcome and devices
(result.json; a failed rank's .expgpu/rank*.failure.json), its loss history (metrics.jsonl);
gpu_pool's pool.json adds GPUs, wall times, errors and jobs that never started. A job dir that is
missing or broken is a row saying so, never the end of the report.

Writes SWEEP_DIR/report.csv (one column per override key, for a spreadsheet or pandas) and
SWEEP_DIR/loss_curves.png (matplotlib's Agg backend: no display needed).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from expgpu.errors import EXIT_USER_ERROR, UserError
from expgpu.rundir import METRICS, POOL_RECORD, RESULT, atomic_write_bytes, failure_files

CSV_FILE = "report.csv"
PNG_FILE = "loss_curves.png"


@dataclass
class Row:
    job: str
    dir: Path | None
    overrides: list[str] = field(default_factory=list)
    status: str = "unknown"
    devices: str = ""
    steps: int | None = None
    final_loss: float | None = None
    accuracy: float | None = None
    wall_s: float | None = None
    error: str = ""
    curve: list[tuple[int, float]] = field(default_factory=list)

    def settings(self) -> dict[str, str]:
        out = {}
        for o in self.overrides:
            key, sep, value = o.partition("=")
            if sep:
                out[key.lstrip("+~")] = value
        return out


def _shown(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("hydra.")]


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


def _curve(path: Path, row: Row) -> tuple[list[tuple[int, float]], float | None]:
    """(step, loss) points and the wall-clock span of metrics.jsonl; bad lines are skipped."""
    points, times, bad = [], [], 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return [], None
    for line in lines:
        try:
            rec = json.loads(line)
            step, loss = int(rec["step"]), float(rec["loss"])
        except (ValueError, KeyError, TypeError):
            bad += bool(line.strip())
            continue
        if math.isfinite(loss):
            points.append((step, loss))
        if isinstance(rec.get("time"), (int, float)):
            times.append(float(rec["time"]))
    if bad and not row.error:
        row.error = f"metrics.jsonl: {bad} unreadable line(s) skipped"
    return points, (max(times) - min(times)) if len(times) > 1 else None


def _devices(result: dict, simulated: bool) -> str:
    parts = []
    for r in result.get("plan") or []:
        if not isinstance(r, dict):
            continue
        gpus = ",".join(str(g) for g in r.get("gpus") or [])
        device = str(r.get("device", "?"))
        if gpus:
            parts.append(f"GPU {gpus}" + (" (sim)" if simulated or not device.startswith("cuda") else ""))
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


def read_job(job_dir: Path, name: str, pool: dict | None = None) -> Row:
    """Everything the report knows about one job, from its dir (and pool.json's entry)."""
    row = Row(job=name, dir=job_dir)
    pool = pool or {}
    row.overrides = _shown(pool.get("overrides") or [])
    if not job_dir.is_dir():
        row.status = pool.get("state") if pool.get("state") in ("not_started", "queued") else "missing"
        row.error = pool.get("error") or ("" if row.status != "missing" else "no job dir")
        return row
    found = _overrides(job_dir, row)
    if found is not None:
        row.overrides = _shown(found)
    result = _read_json(job_dir / RESULT, row)
    row.curve, span = _curve(job_dir / METRICS, row)
    if result is not None:
        row.status = str(result.get("status", "unknown"))
        metrics = result.get("metrics") or {}
        row.final_loss, row.accuracy = metrics.get("final_loss"), metrics.get("accuracy")
        row.steps = result.get("steps")
        row.devices = _devices(result, _is_simulated(job_dir))
        timing = result.get("timing") or {}
        if isinstance(timing.get("train_s"), (int, float)):
            row.wall_s = round(float(timing.get("startup_s") or 0) + float(timing["train_s"]), 3)
    elif row.status != "broken":
        failures = failure_files(job_dir)
        if failures:
            info = _read_json(failures[0], row) or {}
            row.status, row.error = "failed", str(info.get("message", row.error))
        else:
            row.status = "no result"
    if pool:
        # The launcher saw how each job ended, and which ones are still running or never ran.
        state = pool.get("state")
        if state in ("failed", "stopped") and row.status != "broken":
            row.status = state
        elif state in ("running", "queued", "not_started") and row.status == "no result":
            row.status = state
        row.error = pool.get("error") or row.error
        if pool.get("wall_s") is not None:
            row.wall_s = pool["wall_s"]
        if not row.devices:
            gpus = pool.get("gpus") or []
            sim = " (sim)" if pool.get("simulated") else ""
            row.devices = (f"GPU {','.join(map(str, gpus))}{sim}" if gpus
                           else f"cpu slot {pool['slot']}" if pool.get("slot") is not None else "")
    if row.final_loss is None and row.curve:
        row.final_loss = row.curve[-1][1]
        row.steps = row.steps if row.steps is not None else row.curve[-1][0]
    if row.wall_s is None and span is not None:
        row.wall_s = round(span, 3)
    return row


def _job_dirs(sweep: Path, depth: int = 3) -> list[tuple[str, Path]]:
    """Job dirs under a sweep dir: those Hydra wrote (.hydra/) or expgpu did (result.json).

    Hydra's default subdir is the job number; a subdir pattern may nest, so look a few levels
    down, but not into hidden dirs (.submitit/, .expgpu/) or below a job dir."""
    found = []
    for root, dirs, files in os.walk(sweep):
        path = Path(root)
        rel = path.relative_to(sweep)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if rel.parts and (".hydra" in os.listdir(path) or RESULT in files or METRICS in files):
            found.append((str(rel), path))
            dirs[:] = []
        elif len(rel.parts) >= depth:
            dirs[:] = []
    return sorted(found)


def collect(sweep: Path) -> list[Row]:
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
            rows.append(read_job(job_dir, str(entry.get("num", job_dir.name)), entry))
            seen.add(job_dir.resolve())
        rows += [read_job(p, n) for n, p in _job_dirs(sweep) if p.resolve() not in seen]
        return rows
    jobs = _job_dirs(sweep)
    if not jobs and ((sweep / ".hydra").is_dir() or (sweep / RESULT).exists()):
        return [read_job(sweep, sweep.name)]   # a single run dir
    if not jobs:
        raise UserError(f"{sweep}: no job dirs in it (a job dir holds .hydra/ or result.json); "
                        "give a sweep dir such as outputs/multirun/DATE/TIME")
    rows = [read_job(p, n) for n, p in jobs]
    # Numbered job dirs (Hydra's default subdir): a gap is a job that left nothing behind.
    nums = sorted(int(n) for n, _ in jobs if n.isdigit())
    if nums:
        for gap in sorted(set(range(nums[-1] + 1)) - set(nums)):
            rows.append(read_job(sweep / str(gap), str(gap)))
    return sorted(rows, key=lambda r: (0, int(r.job)) if r.job.isdigit() else (1, r.job))


# ---------------------------------------------------------------------------------------------
# Output

def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def table(rows: list[Row]) -> str:
    head = ("job", "status", "devices", "steps", "final_loss", "accuracy", "wall_s", "overrides")
    lines = [head]
    for r in rows:
        lines.append((r.job, r.status, r.devices or "-", _fmt(r.steps), _fmt(r.final_loss), _fmt(r.accuracy, 3),
                      _fmt(None if r.wall_s is None else round(r.wall_s, 1)), " ".join(r.overrides) or "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    for r in rows:
        if r.error and r.status != "finished":
            text.append(f"  job {r.job}: {r.error}")
    return "\n".join(text)


def write_csv(rows: list[Row], path: Path) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r.settings() if k not in keys]
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["job", *keys, "status", "devices", "steps", "final_loss", "accuracy", "wall_s",
                "overrides", "dir", "error"])
    for r in rows:
        s = r.settings()
        w.writerow([r.job, *(s.get(k, "") for k in keys), r.status, r.devices, _fmt(r.steps),
                    "" if r.final_loss is None else repr(r.final_loss),
                    "" if r.accuracy is None else repr(r.accuracy),
                    "" if r.wall_s is None else r.wall_s, " ".join(r.overrides), r.dir or "", r.error])
    atomic_write_bytes(path, out.getvalue().encode())


def plot(rows: list[Row], path: Path, title: str) -> bool:
    """The loss curves of every job that logged one; False when none did."""
    curves = [r for r in rows if len(r.curve) >= 1]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display: a file, from a terminal, a cluster node or CI
    import matplotlib.pyplot as plt

    # Overrides every job shares go in the title; the legend tells jobs apart by the rest.
    common = [o for o in curves[0].overrides if all(o in r.overrides for r in curves)] if len(curves) > 1 else []
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    try:
        for r in curves:
            steps, losses = zip(*r.curve)
            label = f"#{r.job} " + " ".join(o for o in r.overrides if o not in common)
            ax.plot(steps, losses, marker="o" if len(steps) == 1 else None, linewidth=1.4,
                    label=label[:70] + (" *" if r.status != "finished" else ""))
        if all(loss > 0 for r in curves for _, loss in r.curve):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title + ("\n" + " ".join(common) if common else ""), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best", title="* did not finish" if any(r.status != "finished" for r in curves)
                  else None, title_fontsize=7)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expgpu.report",
                                     description="One row per job of a sweep; report.csv and loss_curves.png.")
    parser.add_argument("sweep_dir", type=Path, help="a sweep dir (outputs/multirun/DATE/TIME) or a run dir")
    parser.add_argument("--no-plot", action="store_true", help="skip loss_curves.png")
    args = parser.parse_args(argv)
    try:
        rows = collect(args.sweep_dir)
    except UserError as e:
        print(f"expgpu.report: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(table(rows))
    csv_path, png = args.sweep_dir / CSV_FILE, args.sweep_dir / PNG_FILE
    try:
        write_csv(rows, csv_path)
        print(f"\n{len(rows)} job(s); wrote {csv_path}")
        if not args.no_plot:
            if plot(rows, png, str(args.sweep_dir)):
                print(f"wrote {png}")
            else:
                print("no loss curves: no job has a metrics.jsonl")
    except OSError as e:
        print(f"expgpu.report: error: cannot write into {args.sweep_dir} ({e.strerror}); "
              "copy the sweep dir somewhere writable", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
