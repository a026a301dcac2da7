"""RUN_DIR/.expgpu/loggers.json: which job this is (for names and groups) and the loggers' run ids.

The job part is written by the process Hydra ran the job in (app.run, before any rank starts), the
only one that knows the sweep and the overrides; spawned ranks and a resume read it here. The ids
(MLflow run, W&B run, TensorBoard dir) are written by rank 0 when it creates them, so a resumed run
(requeue, preemption, a rerun in the same dir) continues the same logger run. Written atomically:
a kill never leaves half a file, and a resume never loses an id.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from expgpu.rundir import atomic_write_bytes, loggers_file


@dataclass
class JobInfo:
    overrides: list[str] = field(default_factory=list)   # the job's own (hydra.overrides.task)
    multirun: bool = False
    sweep_dir: str | None = None    # absolute; the loggers' group (MLflow experiment, W&B group)
    sweep_name: str | None = None   # hydra.sweep.dir as configured (outputs/multirun/DATE/TIME)
    num: int | None = None          # hydra.job.num
    job_name: str = "expgpu"        # hydra.job.name

    @property
    def name(self) -> str:
        """A logger run's name: the job's overrides, as Hydra's override_dirname spells them, less
        the choice of loggers (which says nothing about the experiment)."""
        shown = [o for o in self.overrides if not o.lstrip("+~").startswith(("hydra.", "logger=", "logger."))]
        if shown:
            return ",".join(shown)
        return f"job {self.num}" if self.num is not None else self.job_name

    @property
    def path_name(self) -> str:
        """The name as one safe path component (a TensorBoard run dir)."""
        text = re.sub(r"[^A-Za-z0-9=,._+-]+", "_", self.name)
        return text[:150] or "run"

    @staticmethod
    def from_hydra() -> JobInfo:
        """The running Hydra job's; a plain single run when Hydra is not running one."""
        try:
            from hydra.core.hydra_config import HydraConfig
            from hydra.types import RunMode

            hc = HydraConfig.get()
        except (ImportError, ValueError):
            return JobInfo()
        multirun = hc.mode == RunMode.MULTIRUN
        # Against the dir the user started in, not this process's: with hydra.job.chdir=true the job
        # already runs in its job dir, where a relative sweep dir (multirun/DATE/TIME) is another place.
        sweep_dir = Path(str(hc.runtime.cwd), str(hc.sweep.dir))
        return JobInfo(overrides=[str(o) for o in hc.overrides.task], multirun=multirun,
                       sweep_dir=str(sweep_dir) if multirun else None,
                       sweep_name=str(hc.sweep.dir) if multirun else None,
                       num=int(hc.job.num) if multirun and hc.job.get("num") is not None else None,
                       job_name=str(hc.job.name or "expgpu"))


class LoggerState:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = loggers_file(self.run_dir)
        doc = self._read()
        job = doc.get("job") or {}
        known = {k: v for k, v in job.items() if k in JobInfo.__dataclass_fields__}
        self.job = JobInfo(**known)

    def _read(self) -> dict:
        try:
            doc = json.loads(self.path.read_text())
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, logger: str) -> dict[str, Any] | None:
        """What `logger` saved for this run dir (its run id, ...), or None."""
        value = self._read().get(logger)
        return value if isinstance(value, dict) else None

    def put(self, logger: str, value: dict[str, Any] | None) -> None:
        self._write({**self._read(), logger: value})

    def _write(self, doc: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, (json.dumps(doc, indent=1) + "\n").encode())

    @property
    def store_dir(self) -> Path:
        """Where a sweep-wide store lives: the sweep dir in a multirun, else the run dir."""
        return Path(self.job.sweep_dir) if self.job.multirun and self.job.sweep_dir else self.run_dir.absolute()

    @property
    def group(self) -> str | None:
        """The sweep the job belongs to (None for a single run)."""
        return self.job.sweep_name if self.job.multirun else None


def record_job(run_dir: Path) -> None:
    """In the process Hydra runs the job in, before the ranks start: who this job is."""
    state = LoggerState(run_dir)
    job = JobInfo.from_hydra()
    if state.job.multirun and not job.multirun:
        # A single run in a sweep's job dir is that job resumed by hand (a stop's hint says
        # hydra.run.dir=JOB_DIR): its logger runs stay the sweep's (MLflow store and experiment,
        # W&B group), or the resume would start a second MLflow run in a store of its own.
        return
    state._write({**state._read(), "job": asdict(job)})
