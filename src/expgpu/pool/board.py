"""What a sweep shows while it runs: a live table on a terminal (rich), a log line per event otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from expgpu.pool.jobs import Job

log = logging.getLogger("expgpu.pool")


class Board:
    """Counts of jobs by state, the running, failed and next queued jobs, and what the queue waits for."""

    def __init__(self, jobs: list[Job], pool_desc: str):
        self.jobs, self.pool_desc = jobs, pool_desc
        self.note = ""
        self.live = None
        self.was_live = False
        self._shown = 0.0
        self._held: list[str] | None = None   # event lines waiting for release() (hold)
        self._firsts = 0                       # how many of them go first
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            # No refresh thread (auto_refresh=False): the launcher starts jobs with fork+exec,
            # and a second thread holding a lock at fork time is how children deadlock.
            self.live = Live(self._render(), console=Console(stderr=True), auto_refresh=False,
                             redirect_stdout=False, redirect_stderr=False, transient=False)
            self.live.start()

    def counts(self) -> str:
        by = {s: sum(j.state == s for j in self.jobs) for s in
              ("queued", "running", "ending", "finished", "failed", "stopped", "not_started")}
        # An ending job's process has exited and its GPUs or slot are already another job's: it is
        # done (its outcome is read a moment later). Counted as running, a sweep on 2 slots showed
        # "running 3" for the moment between the next job's start and the outcome.
        done = by["ending"] + by["finished"] + by["failed"] + by["stopped"]
        text = f"done {done}/{len(self.jobs)}"
        bad = [f"{by[s]} {s}" for s in ("failed", "stopped") if by[s]]
        if bad:
            text += f" ({', '.join(bad)})"
        text += f", running {by['running']}, queued {by['queued']}"
        return text + (f", not started {by['not_started']}" if by["not_started"] else "")

    def _render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts = [Text(f"gpu_pool on {self.pool_desc}: {self.counts()}", style="bold")]
        now = time.time()
        shown = [j for j in self.jobs if j.state in ("running", "failed", "stopped")]
        shown += [j for j in self.jobs if j.state == "queued"][:3]
        if shown:
            table = Table(box=None, pad_edge=False)
            for col in ("job", "on", "state", "time", "overrides"):
                table.add_column(col, no_wrap=col != "overrides")
            for j in sorted(shown, key=lambda j: j.num):
                took = (j.ended or now) - j.started if j.started else None
                style = {"failed": "red", "stopped": "yellow", "queued": "dim"}.get(j.state, "")
                table.add_row(f"#{j.num}", j.where if j.state != "queued" else "-", j.state,
                              f"{took:.0f}s" if took is not None else "", j.label, style=style)
            parts.append(table)
        if self.note:
            parts.append(Text(self.note, style="italic"))
        return Group(*parts)

    def event(self, text: str, first: bool = False) -> None:
        """A log line (without a live table); while held, it waits, before the other held ones if `first`."""
        if self.live is None:
            line = f"{text}  [{self.counts()}]"
            if self._held is None:
                log.info("%s", line)
            elif first:
                self._held.insert(self._firsts, line)
                self._firsts += 1
            else:
                self._held.append(line)
        self.tick(force=True)

    def hold(self) -> None:
        """Event lines wait for release(): a round starts the next jobs before it reads how the ended ones went
        (not on the starts' path), and its lines say the ends first (first=True), as they happened."""
        self._held, self._firsts = [], 0

    def release(self) -> None:
        held, self._held = self._held or [], None
        for line in held:
            log.info("%s", line)

    def waiting(self, text: str) -> None:
        if text != self.note:
            self.note = text
            if text and self.live is None:
                log.info("%s", text)
            self.tick(force=True)

    def tick(self, force: bool = False) -> None:
        if self.live is not None and (force or time.monotonic() - self._shown > 0.5):
            self.live.update(self._render(), refresh=True)
            self._shown = time.monotonic()

    def close(self) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.stop()   # draws the final table once more, and leaves it on the screen
            self.live = None
            self.was_live = True
