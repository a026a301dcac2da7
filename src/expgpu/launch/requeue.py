"""After a stop checkpoint is on disk: who requeues the job, and how the process ends.

Exactly one owner acts on each stop signal:
- SIGUSR2 (SLURM's warning before a time limit or a preemption, `--signal=USR2@N`, and
  submitit's own preemption signal) asks the job to requeue itself.
  * Under submitit (hydra/launcher=slurm) submitit installed its USR2 handler before
    expgpu ran. expgpu holds the signal until the ranks have saved, then calls that
    handler: on global rank 0 it pickles the job's checkpoint() (Hydra's launcher
    resubmits the same job), runs `scontrol requeue` and exits; on other ranks it
    does nothing. Submitit also counts timeouts against max_num_timeout.
  * Under plain sbatch + srun global rank 0 runs `scontrol requeue $SLURM_JOB_ID`.
    The job needs to be requeueable (`--requeue`, or JobRequeue=1 in slurm.conf).
  * Outside SLURM it only stops, like SIGTERM.
- SIGTERM: SLURM itself is ending the job (`scontrol requeue`, preemption with
  PreemptMode=REQUEUE, scancel, the time limit) or a user ran `kill`. The checkpoint is
  saved and SLURM decides what comes next; requeueing here would fight a scancel.
- SIGINT: a person at a terminal; the same overrides plus hydra.run.dir resume.

Either way a requeued job starts in the same run dir (expgpu.rundir keys it by the job id)
and resumes from the checkpoint. Rank 0 exits with 128 + the signal (130, 140, 143), the
other ranks with 0: rank 0 may still be requeueing, and `srun --kill-on-bad-exit` would end
it at another rank's non-zero exit. Under submitit a stopped process ends with SystemExit
and no result: a result pickle would tell submitit, and so Hydra, that the job is over.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from expgpu.errors import UserError
from expgpu.procs.stop_signals import StopSignals
from expgpu.slurm.cluster import scontrol_requeue

REQUEUE_SIGNAL = "SIGUSR2"


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The job to requeue: an array task by its own id (SLURM_JOB_ID is unique per task)."""
    return env.get("SLURM_JOB_ID") or None


def under_submitit(env: Mapping[str, str]) -> bool:
    return bool(env.get("SUBMITIT_EXECUTOR"))


def after_stop(stopper: StopSignals, rank: int, run_dir, env: Mapping[str, str] | None = None) -> str:
    """Act on a stop whose checkpoint all ranks have saved; returns what comes next, for the user.

    May not return: under submitit it ends the process (SystemExit), after submitit's own
    handler requeued the job on rank 0.
    """
    env = os.environ if env is None else env
    reason = stopper.agreed or stopper.received
    owner = stopper.previous_handler(signal.SIGUSR2)
    if reason == REQUEUE_SIGNAL and owner is not None:
        owner(signal.SIGUSR2, None)  # submitit: rank 0 requeues and calls sys.exit; others return
    if under_submitit(env):
        # 0 on other ranks: under srun a non-zero code could end rank 0 before it is done
        raise SystemExit(stopper.exit_code if rank == 0 else 0)
    job = slurm_job_id(env)
    if job is None or owner is not None or reason == "SIGINT":
        return ""
    if reason == "SIGTERM":
        return (f"If SLURM requeues job {job} (scontrol requeue, preemption), it resumes from it by "
                f"itself; otherwise resume with the same overrides plus hydra.run.dir={run_dir}")
    if rank == 0:
        try:
            scontrol_requeue(job)
        except UserError as e:
            raise UserError(f"{e}; the checkpoint is saved: resubmit with hydra.run.dir={run_dir} "
                            "to resume") from None
    return f"Requeued SLURM job {job}: it resumes from this checkpoint in {run_dir}"
