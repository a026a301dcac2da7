"""The sweep-end report: a Hydra callback (conf/config.yaml, hydra.callbacks.report) that writes
report.csv, loss_curves.png and report.html into the sweep dir when a multirun ends, under any
launcher and sweeper, and logs the best job in one line.

Hydra skips on_multirun_end when a job failed (its sweeper re-raises the job's error), which is
when a report helps most: so the report is also written at exit when the sweep did not end well.
Hydra instantiates callbacks on every start: nothing heavy is imported here until a sweep ends.
Remove it with `~hydra.callbacks.report`.
"""

from __future__ import annotations

import atexit
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

log = logging.getLogger("expgpu")


class SweepReport(Callback):
    def __init__(self, plot: bool = True) -> None:
        self.plot = plot
        self.sweep: Path | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.sweep = Path(str(config.hydra.sweep.dir))
        atexit.register(self._at_exit)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        atexit.unregister(self._at_exit)
        self._write(quiet=False)

    def _at_exit(self) -> None:
        self._write(quiet=True)

    def _write(self, quiet: bool) -> None:
        sweep, self.sweep = self.sweep, None
        if sweep is None or not sweep.is_dir():
            return
        try:
            from expgpu.report import HTML_FILE, collect, rank, write
            from expgpu.report.table import headline, rerun

            rows = collect(sweep)
            ranking = rank(rows)
            write(sweep, rows, ranking, plot=self.plot)
        except Exception as e:   # e.g. no job dir at all (every job failed to compose): nothing to report
            log.debug("no sweep report for %s: %s", sweep, e)
            return
        failed = sum(r.status not in ("finished", "pruned") for r in rows)
        pruned = sum(r.status == "pruned" for r in rows)
        line = f"sweep report: {sweep / HTML_FILE}"
        if not quiet:
            line += (f" ({len(rows)} jobs{f', {pruned} pruned' if pruned else ''}"
                     f"{f', {failed} unfinished' if failed else ''}); {headline(ranking)}")
            log.info("%s", line)
            if rerun(rows, ranking):
                log.info("%s", rerun(rows, ranking))
        else:
            # After a failed sweep: the error stays the one line on stderr; this one says, on
            # stdout, where the whole picture is.
            print(f"expgpu: {line}", flush=True)
