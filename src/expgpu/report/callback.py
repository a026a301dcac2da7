"""The sweep report: a Hydra callback (conf/config.yaml, hydra.callbacks.report) that writes
report.csv and report.html into the sweep dir from the sweep's start and as its jobs end
(expgpu.report.live: the page reloads itself while the sweep runs), and report.csv, loss_curves.png
and report.html when the multirun ends, under any launcher and sweeper, and logs the best job in one line.

Hydra skips on_multirun_end when a job failed (its sweeper re-raises the job's error), which is
when a report helps most: so the report is also written at exit when the sweep did not end well
(its page says failed or stopped). A process killed outright leaves the last running page, which
says how old it is. Under slurm_pool the command on the login node writes nothing: the same command
inside the allocation runs the sweep, and its report.
Hydra instantiates callbacks on every start: nothing heavy is imported here until a sweep starts.
Remove it with `~hydra.callbacks.report`; `hydra.callbacks.report.live=false`: at the end only;
`hydra.callbacks.report.refresh_s=N`: live writes at most every N seconds.
"""

from __future__ import annotations

import atexit
import logging
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from expgpu.errors import plural
from expgpu.results import CUT_SHORT, FINAL

log = logging.getLogger("expgpu")

# The launcher whose sweep runs in another process, inside a SLURM allocation (expgpu.slurm.sweep_job)
_ELSEWHERE = ("hydra_plugins.expgpu_launchers.slurm_pool.SlurmPoolLauncher",)


class SweepReport(Callback):
    def __init__(self, plot: bool = True, live: bool = True, refresh_s: float = 5.0) -> None:
        self.plot, self.live, self.refresh_s = plot, live, refresh_s
        self.sweep: Path | None = None
        self.writer = None   # expgpu.report.live.LiveReport while the sweep runs
        self.plan: list[list[str]] | int | None = None

    def __getstate__(self) -> dict:
        # Launchers pickle Hydra's callbacks into every job (gpu_pool, submitit): the sweep's writer
        # (a thread, a lock) stays in the sweep's process.
        return {**self.__dict__, "writer": None}

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        if OmegaConf.select(config, "hydra.launcher._target_", default=None) in _ELSEWHERE:
            return
        # Absolute: a job of the basic launcher may change the working dir (hydra.job.chdir=true).
        self.sweep = Path(str(config.hydra.sweep.dir)).absolute()
        atexit.register(self._at_exit)
        if self.live:
            from expgpu.report.live import LiveReport
            from expgpu.report.plan import planned

            self.plan = planned(config)
            self.writer = LiveReport(self.sweep, self.plan, self.refresh_s)
            self.writer.start()

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        atexit.unregister(self._at_exit)
        self._write(finished=True)

    def _at_exit(self) -> None:
        self._write(finished=False)

    def _write(self, finished: bool) -> None:
        sweep, self.sweep = self.sweep, None
        if self.writer is not None:
            self.writer.stop()
        if sweep is None or not sweep.is_dir():
            return
        try:
            from expgpu.report import HTML_FILE, rank, state, write
            from expgpu.report.collect import collect
            from expgpu.report.table import headline, rerun

            rows = state.settle(collect(sweep), self.plan, running=False)
            ranking = rank(rows)
            progress = state.progress(rows, self.plan, state.over(rows, finished), time.time())
            write(sweep, rows, ranking, plot=self.plot, progress=progress)
        except Exception as e:   # e.g. no job dir at all (every job failed to compose): nothing to report
            log.debug("no sweep report for %s: %s", sweep, e)
            return
        failed = sum(r.status not in FINAL for r in rows)
        cut = "".join(f", {n} {status}" for status in CUT_SHORT if (n := sum(r.status == status for r in rows)))
        line = f"sweep report: {sweep / HTML_FILE}"
        if finished:
            line += (f" ({plural(len(rows), 'job')}{cut}"
                     f"{f', {failed} unfinished' if failed else ''}); {headline(ranking)}")
            log.info("%s", line)
            if rerun(rows, ranking):
                log.info("%s", rerun(rows, ranking))
        else:
            # After a failed sweep: the error stays the one line on stderr; this one says, on
            # stdout, where the whole picture is.
            print(f"expgpu: {line}", flush=True)
