"""logger=mlflow: an MLflow run per job, an experiment per sweep, offline by default.

    mlflow ui --backend-store-uri sqlite:///$PWD/outputs/multirun/2025-01-31/12-00-00/mlflow.db

The tracking store is logger.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI (a server of yours is
kept), else a local sqlite file in the sweep dir (a single run: its run dir), with artifacts beside
it: nothing needs a network, nothing lands in the working directory. The experiment is the sweep
dir (logger.mlflow.experiment to choose), the run's name the job's overrides; its parameters the
flat resolved config, its tags the overrides and the run dir; at the end the returned metrics and
a status: FINISHED, KILLED (stopped on a signal: a resume continues it) or FAILED.

The run id is kept in the run dir: a resumed run continues the same MLflow run, from the last step
that run holds (asked of the store), so its history has every step once. Rows are sent in batches,
at most every SEND_EVERY_S seconds (MLflow writes a database row per value).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from expgpu.loggers import base
from expgpu.loggers.state import LoggerState
from expgpu.results import CUT_SHORT, FINAL

SEND_EVERY_S = 2.0
_MAX_BATCH = 1000          # MLflow's limit of metrics per log_batch
_MAX_PARAMS = 100          # ... and of params
_MAX_VALUE = 6000          # ... and of a param value's length


class MlflowLogger:
    name = "mlflow"

    def __init__(self, settings: dict, cfg: dict, state: LoggerState):
        self.settings, self.cfg, self.state = settings, cfg, state
        self.client = None
        self.run_id: str | None = None
        self.pending: list = []
        self.sent_at = 0.0

    def _store(self) -> tuple[str, Path | None]:
        """The tracking URI, and the local dir expgpu owns it in (None for a URI of the user's)."""
        uri = self.settings.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return uri, None
        where = self.state.store_dir
        return f"sqlite:///{where / 'mlflow.db'}", where

    def start(self, resumed: bool, step: int, flushed_before: int) -> int:
        from filelock import FileLock
        from mlflow.tracking import MlflowClient

        # A new store logs its schema migration at INFO, to stderr, once per sweep: quiet it, unless
        # the user chose a level. After the import: importing mlflow sets its loggers' levels.
        migration = logging.getLogger("mlflow.store.db.utils")
        if migration.level == logging.NOTSET and not os.environ.get("MLFLOW_LOGGING_LEVEL"):
            migration.setLevel(logging.WARNING)

        uri, local = self._store()
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
        # Jobs of a sweep start together: the first one creates the database (MLflow migrates
        # its schema) and the experiment; the others wait for it instead of racing it.
        lock = FileLock(str(local / ".mlflow.lock")) if local is not None else None
        if lock is not None:
            lock.acquire(timeout=300)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            experiment_id = self._experiment(local)
        finally:
            if lock is not None:
                lock.release()
        saved = self.state.get(self.name) or {}
        job = self.state.job
        if resumed and saved.get("run_id") and saved.get("tracking_uri") == uri and self._exists(saved["run_id"]):
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self._params()
            return self._last_step()
        tags = {"mlflow.runName": job.name, "expgpu.overrides": " ".join(job.overrides),
                "expgpu.run_dir": str(self.state.run_dir.absolute())}
        if job.multirun:
            tags["expgpu.sweep_dir"] = str(job.sweep_dir)
        run = self.client.create_run(experiment_id, run_name=job.name, tags=tags)
        self.run_id = run.info.run_id
        self.state.put(self.name, {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": uri})
        self._params()
        return -1

    def _experiment(self, local: Path | None) -> str:
        job = self.state.job
        name = self.settings.get("experiment") or (job.sweep_name if job.multirun else job.job_name)
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        artifacts = (local / "mlartifacts").as_uri() if local is not None else None
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except Exception:
            found = self.client.get_experiment_by_name(name)   # created meanwhile by another job
            if found is None:
                raise
            return found.experiment_id

    def _exists(self, run_id: str) -> bool:
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except Exception:
            return False   # deleted in the UI, or another store: a new run

    def _params(self) -> None:
        """The resolved config as params; on a resume only those the run lacks (MLflow refuses to
        change a param, and a resume may raise task.max_steps)."""
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        params = [Param(k[:250], str(v)[:_MAX_VALUE]) for k, v in base.hyperparameters(self.cfg).items()
                  if k[:250] not in have]
        for i in range(0, len(params), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[i:i + _MAX_PARAMS])

    def _last_step(self) -> int:
        run = self.client.get_run(self.run_id)
        steps = [m.step for key in run.data.metrics for m in self.client.get_metric_history(self.run_id, key)]
        return max(steps, default=-1)

    def write(self, rows: list[dict]) -> None:
        from mlflow.entities import Metric

        for row in rows:
            ms = int(1000 * row.get("time", time.time()))
            self.pending += [Metric(k, float(v), ms, row["step"]) for k, v in base.values(row).items()]
        if time.monotonic() - self.sent_at >= SEND_EVERY_S:
            self._send()

    def _send(self) -> None:
        batch, self.pending = self.pending, []
        for i in range(0, len(batch), _MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + _MAX_BATCH])
        self.sent_at = time.monotonic()

    def finish(self, status: str, metrics: dict, step: int, last_row: dict) -> None:
        from mlflow.entities import Metric

        if self.client is None:
            return
        now = int(1000 * time.time())
        self.pending += [Metric(k, float(v), now, step) for k, v in base.final_metrics(metrics, last_row).items()]
        try:
            self._send()
        finally:
            if status in CUT_SHORT:   # final as a finished run (nothing resumes it), told apart by its tag
                self.client.set_tag(self.run_id, "expgpu.status", status)
            self.client.set_terminated(self.run_id, "FINISHED" if status in FINAL else
                                       "KILLED" if status == "stopped" else "FAILED")
