"""Where metrics go besides metrics.jsonl: the `logger` config group (csv, tensorboard, mlflow, wandb).

    python -m expgpu task=a logger=[csv,tensorboard]
    python -m expgpu -m task=a,b logger=mlflow hydra/launcher=gpu_pool

Rank 0 only, fed at MetricsLog's flush with exactly the rows it writes to metrics.jsonl (same steps,
same values), plus the resolved config and the job's overrides as hyperparameters and the returned
metrics at the end. Each logger's package is imported only when it is chosen, and only in rank 0.

A resumed run (preemption, requeue, a rerun in the same run dir) continues the same logger run: the
ids live in the run dir (.expgpu/loggers.json). Every logger says, when it starts, up to which step
it already holds rows; rows at or before that step are not sent again (a crash after the last
checkpoint already sent them), and rows it misses up to the resumed step are sent from
metrics.jsonl (a logger added on the resume). So each logger ends with every step once.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from expgpu.errors import UserError, first_line
from expgpu.loggers.base import Sink, final_metrics, hyperparameters, values
from expgpu.loggers.jsonl import read_rows
from expgpu.loggers.state import JobInfo, LoggerState, record_job

log = logging.getLogger("expgpu")

NAMES = ("csv", "tensorboard", "mlflow", "wandb")
# The package each logger imports, and the pip extra that installs it.
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def chosen(cfg: dict) -> dict[str, dict]:
    """The loggers the config selects, with their settings (logger=none: none)."""
    return {name: dict(s) for name, s in (cfg.get("logger") or {}).items() if s is not None}


def check(cfg: dict) -> None:
    """Before any rank starts: every chosen logger's package is importable (without importing it)."""
    for name in chosen(cfg):
        package = PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise UserError(f"logger={name}: the {package} package is not installed: pip install 'expgpu[{name}]' "
                            f"(or choose another logger: {', '.join(NAMES)}, none)")


def build(cfg: dict, run_dir: Path) -> Loggers | None:
    """rank 0's loggers (nothing imported yet), or None when none is chosen."""
    wanted = chosen(cfg)
    if not wanted:
        return None
    state = LoggerState(Path(run_dir))
    made = []
    for name, settings in wanted.items():
        if name == "csv":
            from expgpu.loggers.csv import CsvLogger as cls
        elif name == "tensorboard":
            from expgpu.loggers.tensorboard import TensorBoardLogger as cls
        elif name == "mlflow":
            from expgpu.loggers.mlflow import MlflowLogger as cls
        elif name == "wandb":
            from expgpu.loggers.wandb import WandbLogger as cls
        else:
            raise UserError(f"logger.{name}: no such logger; allowed: {', '.join(NAMES)}, none")
        made.append(cls(settings, cfg, state))
    return Loggers(made, state)


class Loggers(Sink):
    """The chosen loggers as one: started once, fed each flush's rows, finished with the result."""

    def __init__(self, loggers: list, state: LoggerState):
        self.loggers = loggers
        self.state = state
        self.held: dict[str, int] = {}     # per logger: the last step it already holds
        self.started = False

    def start(self, resumed: bool, step: int, flushed_before: int, jsonl: Path) -> None:
        self.started = True
        for lg in list(self.loggers):
            try:
                self.held[lg.name] = lg.start(resumed, step, flushed_before)
            except UserError:
                raise
            except Exception as e:
                raise UserError(f"logger {lg.name} could not start: {type(e).__name__}: {first_line(e)}") from None
        behind = [lg for lg in self.loggers if self.held[lg.name] < step]
        history = read_rows(jsonl) if behind else []   # already trimmed to `step`
        for lg in behind:
            rows = [r for r in history if self.held[lg.name] < r["step"] <= step]
            if rows:
                self._send(lg, rows)

    def write(self, rows: list[dict]) -> None:
        for lg in list(self.loggers):
            new = [r for r in rows if r["step"] > self.held.get(lg.name, -1)]
            if new:
                self._send(lg, new)

    def _send(self, lg, rows: list[dict]) -> None:
        try:
            lg.write(rows)
        except Exception as e:
            # A tracking store that fails mid-run (a full disk, a lost server) must not end hours of
            # training: metrics.jsonl still has every row.
            log.warning("logger %s failed and is off for the rest of this run: %s: %s", lg.name,
                        type(e).__name__, first_line(e))
            self.loggers.remove(lg)

    def finish(self, status: str, metrics: dict, step: int, last_row: dict | None) -> None:
        if not self.started:
            if status != "finished":
                return   # failed before any row: no logger run for a run that never trained
            self.start(False, 0, -1, Path("/nonexistent"))
        for lg in list(self.loggers):
            try:
                lg.finish(status, metrics, step, last_row or {})
            except Exception as e:
                log.warning("logger %s could not finish: %s: %s", lg.name, type(e).__name__, first_line(e))


__all__ = ["JobInfo", "LoggerState", "Loggers", "NAMES", "Sink", "build", "check", "chosen", "final_metrics",
           "hyperparameters", "record_job", "values"]
