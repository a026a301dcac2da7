"""logger=csv: metrics.csv beside metrics.jsonl, for a spreadsheet or pandas.read_csv.

Columns: step, then every logged name in the order it first appeared, then epoch and time. A row
holds what metrics.jsonl's row of that step holds (the rest empty). A name that appears later (the
first evaluation) adds a column: the file is then rewritten whole, atomically, with the new header;
otherwise rows are appended. On a resume the rows after the checkpoint's step go, as in
metrics.jsonl; a rerun from scratch starts the file anew.
"""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path

from expgpu.loggers.jsonl import WRITE_EVERY_S
from expgpu.loggers.progress import FIELDS
from expgpu.loggers.state import LoggerState

_FIRST, _LAST = ["step"], ["epoch", "time"]


class CsvLogger:
    name = "csv"

    def __init__(self, settings: dict, cfg: dict, state: LoggerState):
        self.path = state.run_dir / str(settings.get("file") or "metrics.csv")
        self.columns: list[str] = []
        self.file = None
        self.written_at = 0.0   # when rows were last handed to the OS

    def start(self, resumed: bool, step: int, flushed_before: int) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)   # logger.csv.file=csv/metrics.csv: its dir too
        kept: list[dict] = []
        if resumed and self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                for row in reader:
                    try:
                        if int(row["step"]) <= step:
                            kept.append(row)
                    except (KeyError, TypeError, ValueError):
                        continue   # a row torn by a kill mid-write
        self._rewrite(kept)
        return max((int(r["step"]) for r in kept), default=-1)

    def write(self, rows: list[dict]) -> None:
        rows = [{k: v for k, v in r.items() if k not in FIELDS} for r in rows]   # the progress stays in metrics.jsonl
        new = [k for r in rows for k in r if k not in self.columns]
        if new:
            for k in dict.fromkeys(new):
                if k in _LAST:
                    self.columns.append(k)
                else:
                    self.columns.insert(len(self.columns) - sum(c in _LAST for c in self.columns), k)
            self._rewrite(self._read() + rows)
            return
        w = csv.DictWriter(self.file, self.columns, restval="")
        w.writerows(rows)
        if time.monotonic() - self.written_at >= WRITE_EVERY_S:   # as metrics.jsonl (expgpu.loggers.jsonl)
            self.file.flush()
            self.written_at = time.monotonic()

    def finish(self, status: str, metrics: dict, step: int, last_row: dict) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def _read(self) -> list[dict]:
        if self.file is not None:
            self.file.flush()
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))

    def _rewrite(self, rows: list[dict]) -> None:
        from expgpu.rundir import atomic_write_bytes

        if not self.columns:
            self.columns = _FIRST + _LAST
        out = io.StringIO()
        w = csv.DictWriter(out, self.columns, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        if self.file is not None:
            self.file.close()
        atomic_write_bytes(Path(self.path), out.getvalue().encode())
        self.file = open(self.path, "a", newline="")
