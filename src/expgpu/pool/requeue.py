"""A sweep's batch allocation requeues itself when SLURM warns of its end.

Inside a batch allocation (hydra/launcher=slurm_pool's, or a user's sbatch script), SIGUSR2 is SLURM's
warning before the time limit (`--signal=B:USR2@N`, to the batch shell, which hands it to the sweep).
The pool stops its running jobs as for SIGTERM (their ranks checkpoint and end), and once the sweep has
written what it keeps (pool.json, the study's summary), as this process's last act, runs
`scontrol requeue` on the allocation: SLURM runs the same script again, the same command in the same
sweep dir, where finished jobs are kept (expgpu.pool.kept), cut jobs resume from their checkpoints,
and an Optuna study continues from its journal (expgpu.tune.sweep).

At most hydra.launcher.max_requeues times (SLURM_RESTART_COUNT counts them); 0, the default outside
slurm_pool, only stops. A preemption or `scontrol requeue` sends SIGTERM instead: SLURM ends the job and
decides itself whether it comes back (PreemptMode=REQUEUE does), so the pool only saves.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from expgpu.errors import UserError
from expgpu.slurm.cluster import scontrol_requeue

log = logging.getLogger("expgpu.pool")


def after_stop(job_id: str, stop_signal: int | None, max_requeues: int, sweep_dir: Path,
               env: Mapping[str, str]) -> None:
    """After the pool inside allocation `job_id` stopped on `stop_signal`: the requeue, at exit, when asked for."""
    if stop_signal != signal.SIGUSR2:
        return
    restart = _restarts(env)
    again = f"rerun the same command with hydra.sweep.dir={sweep_dir} to continue the sweep"
    if max_requeues == 0:
        log.warning("gpu_pool: SIGUSR2: the running jobs saved; not requeued (hydra.launcher.max_requeues=0): %s",
                    again)
    elif restart >= max_requeues:
        log.warning("gpu_pool: SIGUSR2: the running jobs saved; not requeued: SLURM job %s was requeued %d time(s) "
                    "already (hydra.launcher.max_requeues=%d): %s", job_id, restart, max_requeues, again)
    else:
        atexit.register(_requeue, job_id, restart + 1, max_requeues)


def _restarts(env: Mapping[str, str]) -> int:
    try:
        return int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def _requeue(job_id: str, nth: int, max_requeues: int) -> None:
    """The last act of the sweep's process: SLURM ends this job (SIGTERM) and queues it again."""
    try:
        scontrol_requeue(job_id)
    except UserError as e:
        print(f"expgpu: error: {e}", file=sys.stderr, flush=True)
        return
    print(f"gpu_pool: requeued SLURM job {job_id} ({nth} of at most {max_requeues}): the sweep continues in the "
          "same sweep dir when it runs again", file=sys.stderr, flush=True)
