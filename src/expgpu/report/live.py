"""report.html and report.csv while a sweep runs: written when the sweep dir appears (the planned jobs
queued), rewritten as jobs start and end, and at least every HEARTBEAT_S; the sweep-end report
(expgpu.report.callback) writes the last one.

One background thread in the sweep's process watches the sweep dir, not the launcher: a job's end is a
result.json or a failure record in its dir, gpu_pool's pool.json or a study's study.json changing. So it
works the same under every launcher and sweeper, jobs on this machine or on SLURM nodes (their dirs on a
shared file system). Off the sweep's path: the thread looks at the dir with a few stat() calls every
POLL_S, and writes at most every refresh_s (job ends in between coalesce into one write), and never
more than DUTY of the time (a write that took t waits t / DUTY before the next): the GIL it holds while
it writes is time the launcher's loop or an in-process job waits. A finished job's row is read once
(cached on its files' sizes and times), and no curves are drawn while running (matplotlib takes seconds;
the end draws them). Writes are atomic (rundir.atomic_write_bytes): a browser never reads half a page.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path

from expgpu.report import state as states
from expgpu.report.collect import Row, job_dirs, read_job
from expgpu.rundir import METRICS, POOL_RECORD, RESULT, STUDY, state_dir

log = logging.getLogger("expgpu")

POLL_S = 1.0         # how often the sweep dir is looked at (stat calls only)
HEARTBEAT_S = 60.0   # a running sweep's page is rewritten at least this often: its age tells a dead sweep
STALE_S = 3 * HEARTBEAT_S   # past this age a running page says its sweep's process may be gone
DUTY = 0.05          # the most of the process's time the writes may take


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def fingerprint(sweep: Path) -> tuple:
    """What changes when a job starts or ends, whatever the launcher (no file is read)."""
    marks: list = [_stat(sweep / POOL_RECORD), _stat(sweep / STUDY)]
    for name, job in job_dirs(sweep):
        marks.append((name, _stat(job / RESULT), _stat(state_dir(job))))
    return tuple(marks)


class LiveReport:
    def __init__(self, sweep: Path, plan: list[list[str]] | int | None, refresh_s: float = 5.0):
        self.sweep, self.plan = Path(sweep), plan
        self.refresh_s = max(0.2, float(refresh_s))
        self.writes = 0
        self._cache: dict[tuple[str, str], tuple[tuple, Row]] = {}
        self._lock = threading.Lock()   # one writer at a time; the last write closes it to the thread
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="expgpu-live-report", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No live write after this returns (one under way finishes first)."""
        self._stop.set()
        with self._lock:
            self._closed = True

    def _loop(self) -> None:
        last_mark, last_write, next_write = None, 0.0, 0.0
        while not self._stop.is_set():
            try:
                if self.sweep.is_dir():   # the sweeper makes it: a sweep that fails to start leaves none
                    mark = fingerprint(self.sweep)
                    now = time.monotonic()
                    if now >= next_write and (mark != last_mark or now - last_write >= HEARTBEAT_S):
                        self.write_running()
                        took = time.monotonic() - now
                        last_mark, last_write = mark, now
                        next_write = now + max(self.refresh_s, took / DUTY)
            except Exception as e:   # never the sweep's end: the next look tries again
                log.debug("live report of %s: %s", self.sweep, e)
            self._stop.wait(min(POLL_S, self.refresh_s) if self.writes else 0.1)

    def write_running(self) -> None:
        from expgpu.report import write
        from expgpu.report.best import rank

        with self._lock:
            if self._closed:
                return
            rows = states.settle(self.rows(), self.plan, running=True)
            reload_s = max(2, round(self.refresh_s))
            progress = states.progress(rows, self.plan, "running", time.time(), reload_s, STALE_S)
            write(self.sweep, rows, rank(rows), plot=False, progress=progress)
            self.writes += 1

    def rows(self) -> list[Row]:
        from expgpu.errors import UserError
        from expgpu.report.collect import collect

        try:
            return collect(self.sweep, read=self._read)
        except UserError:   # no job dir yet
            return []

    def _read(self, job_dir: Path, name: str, pool: dict | None = None) -> Row:
        """read_job, again only when one of the job's files (or its pool.json entry) changed."""
        files = (RESULT, METRICS, ".hydra/overrides.yaml", ".hydra/config.yaml")
        sig = (*(_stat(job_dir / f) for f in files), _stat(state_dir(job_dir)),
               json.dumps(pool, sort_keys=True, default=str))
        key = (name, os.fspath(job_dir))
        hit = self._cache.get(key)
        if hit is None or hit[0] != sig:
            hit = self._cache[key] = (sig, read_job(job_dir, name, pool))
        return dataclasses.replace(hit[1])   # settle() may change its copy's status
