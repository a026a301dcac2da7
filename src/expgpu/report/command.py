"""`expgpu report SWEEP_DIR`'s command line (`expgpu-report`, `python -m expgpu.report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from expgpu.errors import EXIT_USER_ERROR, UserError, stdout_gone
from expgpu.report.best import rank
from expgpu.report.collect import collect
from expgpu.report.files import PNG_FILE, write


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
