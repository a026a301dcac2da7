"""hydra/sweeper=expgpu_optuna: expgpu's own Optuna sweeper.

Trials start the moment a slot frees (gpu_pool, SLURM), report the objective to the study each
time rank 0 writes it to metrics.jsonl, stop together when the pruner says so, and a rerun of the
same sweep dir continues the study. One module per part:

    settings.py   the sweeper's keys, checked (one line naming a bad one), sampler and pruner built
    space.py      `params` in Hydra's sweep syntax -> Optuna distributions, and a trial's overrides
    storage.py    where the study lives: a journal file in the sweep dir, or any Optuna storage URL
    study.py      the study opened or continued, trials told, study.json for the report
    bridge.py     in the job: run.log's rows -> trial.report / should_prune -> a PRUNED stop request
    runners.py    how trials run: the pool's Session, one submitit job per trial, or Hydra's batches
    sweep.py      the loop: ask, start, wait for any, tell; resume what a dead sweeper left running

Nothing here imports Optuna at import time: Hydra imports every plugin at every start.
"""

# The environment variable that attaches a job to its trial: the path of the trial's file
# (SWEEP_DIR/.expgpu/trial-<n>.json), set through the job's hydra.job.env_set by the sweeper.
from expgpu.envvars import TRIAL as TRIAL_ENV

__all__ = ["TRIAL_ENV"]
