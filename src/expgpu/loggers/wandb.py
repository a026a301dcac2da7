"""logger=wandb: a Weights & Biases run per job, a group per sweep; offline unless you say online.

    python -m expgpu -m task=a,b logger=wandb                        # offline: under each run dir
    wandb sync outputs/multirun/2025-01-31/12-00-00/*/wandb/offline-run-*     # upload later
    python -m expgpu task=a logger=wandb logger.wandb.mode=online logger.wandb.project=mine

Offline mode writes RUN_DIR/wandb/ and needs no network and no account. The run's name is the
job's overrides, its group the sweep dir, its config the flat resolved config plus the overrides;
rows at metrics.jsonl's steps; the returned metrics in its summary.

The run id is kept in the run dir: a resumed run calls wandb.init with the same id and
resume="allow", so it continues the same W&B run (offline, `wandb sync` joins the pieces). Rows
sent before a crash, after the last checkpoint, are not sent again (W&B drops a step it has seen).
"""

from __future__ import annotations

import uuid

from expgpu.loggers import base
from expgpu.loggers.state import LoggerState
from expgpu.results import FINAL


class WandbLogger:
    name = "wandb"

    def __init__(self, settings: dict, cfg: dict, state: LoggerState):
        self.settings, self.cfg, self.state = settings, cfg, state
        self.run = None

    def start(self, resumed: bool, step: int, flushed_before: int) -> int:
        import wandb

        saved = self.state.get(self.name) or {}
        job = self.state.job
        continuing = resumed and bool(saved.get("id"))
        # W&B's own id maker moved between releases: 8 lowercase hex characters, as W&B's ids are.
        run_id = saved["id"] if continuing else uuid.uuid4().hex[:8]
        s = self.settings
        self.run = wandb.init(
            project=s.get("project") or "expgpu", entity=s.get("entity"), mode=str(s.get("mode") or "offline"),
            group=s.get("group") or self.state.group, name=job.name, tags=list(s.get("tags") or []) or None,
            id=run_id, resume="allow", dir=str(self.state.run_dir.absolute()),
            config={**base.hyperparameters(self.cfg), "overrides": " ".join(job.overrides)},
            allow_val_change=True,   # a resume may raise task.max_steps
            reinit="finish_previous",   # the basic launcher runs a sweep's jobs in one process
        )
        if not continuing:
            self.state.put(self.name, {"id": run_id})
        # What this W&B run already holds: every row metrics.jsonl had before the stop or crash.
        return flushed_before if continuing else -1

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            self.run.log(base.values(row), step=row["step"])

    def finish(self, status: str, metrics: dict, step: int, last_row: dict) -> None:
        if self.run is None:
            return
        self.run.summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        if status == "stopped":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status in FINAL else 1)   # pruned, diverged: final, not resumed
        self.run = None
