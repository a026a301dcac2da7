"""`expgpu-report SWEEP_DIR` (or `python -m expgpu.report`): which job of a sweep was best, and why
the others failed.

    expgpu-report outputs/multirun/2025-01-31/12-00-00
    expgpu-report outputs/multirun/2025-01-31/12-00-00 --metric eval_accuracy --maximize

One row per job, best first (report.rank says by what), the overrides that tell jobs apart, a
column per metric the jobs returned, a failed job's one-line reason. Writes, into SWEEP_DIR only:
report.csv (one column per override key), loss_curves.png (a panel per metric the jobs logged,
the ranking metric first; matplotlib's Agg backend: no display needed), for a sweep of
hydra/sweeper=expgpu_optuna optimization.png (report.history), and report.html (all on one page).
A sweep writes the same at its end (report.callback), and report.csv and report.html from its start and
as its jobs end (report.live: the page reloads itself while the sweep runs). Never writes into a job dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from expgpu.errors import EXIT_USER_ERROR, UserError, stdout_gone
from expgpu.report.best import Ranking, rank
from expgpu.report.collect import Row, collect, read_job
from expgpu.report.state import Progress

CSV_FILE = "report.csv"
PNG_FILE = "loss_curves.png"
HTML_FILE = "report.html"

__all__ = ["CSV_FILE", "HTML_FILE", "PNG_FILE", "Progress", "Ranking", "Row", "cli", "collect", "main", "rank",
           "read_job", "write"]


def write(sweep: Path, rows: list[Row], ranking: Ranking, plot: bool = True,
          progress: Progress | None = None) -> list[Path]:
    """report.csv, loss_curves.png (unless plot=False, or nothing was logged) and report.html; `progress`:
    where the sweep stands, said at the top of the page (a running sweep's page reloads itself)."""
    from expgpu.report import history, html, table
    from expgpu.report.plot import plot as draw

    written = [sweep / CSV_FILE]
    table.write_csv(rows, ranking, sweep / CSV_FILE)
    pngs = []
    if plot and draw(rows, ranking, sweep / PNG_FILE, str(sweep)) is not None:
        pngs.append(PNG_FILE)
    study = history.read_study(sweep) if plot else None   # an expgpu_optuna sweep's study
    if study is not None and history.plot(study, sweep / history.PNG, f"{sweep}: study {study['study']}"):
        pngs.append(history.PNG)
    written += [sweep / p for p in pngs]
    html.write(rows, ranking, sweep / HTML_FILE, str(sweep), pngs, progress)
    written.append(sweep / HTML_FILE)
    return written


def main(argv: list[str] | None = None, prog: str = "expgpu-report") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Which job of a sweep was best: a table, report.csv, "
                                                            "loss_curves.png and report.html in the sweep dir.")
    parser.add_argument("sweep_dir", type=Path, help="a sweep dir (outputs/multirun/DATE/TIME) or a run dir")
    parser.add_argument("--metric", help="rank by this returned metric (default: the jobs' objective, else the "
                                         "metric most finished jobs returned, a loss or score, held-out first: "
                                         "see docs/status-and-reports.md)")
    way = parser.add_mutually_exclusive_group()
    way.add_argument("--maximize", action="store_const", const=True, dest="maximize", help="higher is better")
    way.add_argument("--minimize", action="store_const", const=False, dest="maximize", help="lower is better")
    parser.add_argument("--no-plot", action="store_true", help="skip loss_curves.png")
    args = parser.parse_args(argv)
    from expgpu.report.table import table

    try:
        rows = collect(args.sweep_dir)
        ranking = rank(rows, args.metric, args.maximize)
        if args.metric and not any(args.metric in r.metrics for r in rows):
            have = sorted({k for r in rows for k in r.metrics})
            raise UserError(f"--metric {args.metric}: no job returned it; they returned "
                            f"{', '.join(have) or 'nothing'}")
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    _say(table(rows, ranking))
    try:
        written = write(args.sweep_dir, rows, ranking, plot=not args.no_plot)
    except OSError as e:
        print(f"{prog}: error: cannot write into {args.sweep_dir} ({e.strerror}); "
              "copy the sweep dir somewhere writable", file=sys.stderr)
        return EXIT_USER_ERROR
    _say(f"\n{len(rows)} job(s); wrote " + ", ".join(str(p) for p in written))
    if not args.no_plot and args.sweep_dir / PNG_FILE not in written:
        _say("no curves: no job has a metrics.jsonl")
    return 0


def _say(text: str) -> None:
    """print(), where the reader may leave before the end (`expgpu-report DIR | head`): the report's files
    are written all the same."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        stdout_gone()


def cli() -> None:
    """The `expgpu-report` script."""
    sys.exit(main())
