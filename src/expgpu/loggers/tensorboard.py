"""logger=tensorboard: event files under the run dir, written with torch's SummaryWriter.

    tensorboard --logdir outputs/multirun/2025-01-31/12-00-00     # a sweep: one run per job

A single run writes RUN_DIR/tensorboard/; a sweep's job writes JOB_DIR/tensorboard/<its overrides>/,
so that TensorBoard, pointed at the sweep dir, names each job's run by what it changed. Scalars at
metrics.jsonl's steps and wall times; at the end the flat resolved config as hyperparameters (the
HPARAMS tab) against the returned metrics, and the overrides as text. A trial pruned by an optimizing
sweeper is in the HPARAMS tab too, against its last row's metrics; `expgpu.status` tells them apart.

A resume writes a new event file into the same dir that starts with a purge at the resumed step:
TensorBoard drops what the old files hold from that step on (rows logged after the checkpoint,
before a crash), so each step shows once. A run started from scratch purges from step 0.
"""

from __future__ import annotations

from pathlib import Path

from expgpu.loggers import base
from expgpu.loggers.state import LoggerState
from expgpu.results import FINAL


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, settings: dict, cfg: dict, state: LoggerState):
        self.settings, self.cfg, self.state = settings, cfg, state
        self.writer = None

    def start(self, resumed: bool, step: int, flushed_before: int) -> int:
        from torch.utils.tensorboard import SummaryWriter

        saved = self.state.get(self.name) or {}
        job = self.state.job
        base = self.state.run_dir / str(self.settings.get("dir") or "tensorboard")
        log_dir = Path(saved["dir"]) if saved.get("dir") else (base / job.path_name if job.multirun else base)
        had_events = any(log_dir.glob("events.out.tfevents.*"))
        # Resumed: the old files hold what metrics.jsonl held up to the checkpoint's step (values
        # logged just before a stop are in the checkpoint, in no file yet: they come with the next
        # rows); what they hold after that, TensorBoard drops. Fresh in a used dir: all of it.
        held = min(step, flushed_before) if resumed and had_events else -1
        self.writer = SummaryWriter(str(log_dir), purge_step=held + 1 if had_events else None)
        if not saved.get("dir"):
            self.state.put(self.name, {"dir": str(log_dir)})
        if held < 0:
            self.writer.add_text("overrides", " ".join(job.overrides) or "(none)", 0)
        return held

    def write(self, rows: list[dict]) -> None:
        add = self.writer.add_scalar
        for row in rows:
            step, wall = row["step"], row.get("time")
            for name, value in base.values(row).items():
                add(name, value, step, walltime=wall)
        # On disk at every flush, not every flush_secs: a resume after a SIGKILL counts on the
        # files holding every row metrics.jsonl held.
        self.writer.flush()

    def finish(self, status: str, metrics: dict, step: int, last_row: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        try:
            final = base.final_metrics(metrics, last_row)
            for name, value in final.items():
                self.writer.add_scalar(name, value, step)
            if status in FINAL:   # final: a stopped run adds its row when it is resumed
                # The HPARAMS tab: every hyperparameter against the metrics the task returned, read
                # from the scalars of those names (their last values). A pruned or diverged run returns
                # none: against what its last row holds (what its pruner judged), beside the finished ones.
                shown = metrics if status == "finished" else base.values(last_row or {})
                names = {k: v for k, v in shown.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                # bool is an int to torch's hparams(), which would show true as 1.0: spell it out.
                values = {k: str(v).lower() if isinstance(v, bool) else v
                          for k, v in base.hyperparameters(self.cfg).items()}
                values |= {"overrides": " ".join(self.state.job.overrides), "expgpu.status": status}
                exp, ssi, sei = hparams(values, names)
                fw = self.writer._get_file_writer()
                for summary in (exp, ssi, sei):
                    fw.add_summary(summary, step)
        finally:
            self.writer.close()
