"""`expgpu status`'s command line (expgpu.status has what it shows): the rows, the table or JSON, --watch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from expgpu.errors import EXIT_USER_ERROR, stdout_gone
from expgpu.status.read import RunRow
from expgpu.status.sweeps import rows
from expgpu.status.table import table


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Where your runs are: one table of the runs and sweeps "
                                                            "under DIR, newest first.")
    parser.add_argument("dir", nargs="?", default="outputs", type=Path,
                        help="a dir of runs (default: outputs), a sweep dir (its jobs), or a run dir")
    parser.add_argument("--watch", nargs="?", const=2.0, type=float, metavar="SECONDS",
                        help="refresh in place every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    return parser


def _rows(top: Path) -> list[RunRow] | str:
    """The rows, or the one line that says why there are none."""
    if not top.is_dir():
        return f"{top}: no such directory; give a dir of runs (default: outputs), a sweep dir or a run dir"
    found = rows(top.resolve())
    if not found:
        return f"{top}: no runs or sweeps in it (a run dir holds .hydra/ or result.json)"
    return found


def main(argv: list[str] | None = None, prog: str = "expgpu status") -> int:
    args = _parser(prog).parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        print(f"{prog}: error: --watch {args.watch:g}: give a positive number of seconds", file=sys.stderr)
        return EXIT_USER_ERROR
    found = _rows(args.dir)
    if isinstance(found, str):
        print(f"{prog}: error: {found}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        if args.watch is None:
            _show(found, args.json)
        else:
            _watch(args.dir, args.watch, args.json, found)
    except KeyboardInterrupt:
        pass   # the way to stop watching: no traceback, exit 0
    except BrokenPipeError:   # the reader left (`| head`): done, watching too
        stdout_gone()
    return 0


def _show(found: list[RunRow], as_json: bool) -> None:
    if as_json:
        print(json.dumps([r.to_json() for r in found], indent=1))
    else:
        print(table(found), flush=True)


def _watch(top: Path, every: float, as_json: bool, found: list[RunRow] | str) -> None:
    """The table again every `every` s: in place on a terminal (cursor home, clear), one after another elsewhere."""
    tty = sys.stdout.isatty() and not as_json
    while True:
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J")
        if isinstance(found, str):
            print(found, flush=True)
        else:
            _show(found, as_json)
        if tty:
            print(f"\n{time.strftime('%H:%M:%S')}  every {every:g} s; Ctrl-C to stop", flush=True)
        elif not as_json:
            print(flush=True)
        time.sleep(every)
        found = _rows(top)
