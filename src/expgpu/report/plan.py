"""The jobs a sweep will run, known at its start: for the live report's "N of M done" and its queued rows.

Hydra's basic sweeper (under any launcher: basic, gpu_pool, slurm) expands the command line's sweeps
into every job's overrides before the first starts: the same expansion here (its own split_arguments),
so job i's row can show as queued before its dir (SWEEP_DIR/i, Hydra's default subdir) exists. An
optimizing sweeper (expgpu_optuna, Hydra's optuna) knows only how many trials it will run (n_trials),
not their parameters. Any other sweeper: unknown (None).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("expgpu")


def planned(config: Any) -> list[list[str]] | int | None:
    """Every job's overrides in job-number order, or the number of trials, or None (unknown)."""
    from omegaconf import OmegaConf

    sweeper = OmegaConf.select(config, "hydra.sweeper", default=None)
    if sweeper is None:
        return None
    target = str(OmegaConf.select(sweeper, "_target_", default="") or "")
    try:
        if target.endswith(".BasicSweeper"):
            jobs = _basic(config, sweeper)
            # Job i's row is the dir named i only under Hydra's default subdir: else only count them
            subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
            return jobs if subdir == "${hydra.job.num}" else len(jobs)
        trials = OmegaConf.select(sweeper, "n_trials", default=None)
        return int(trials) if isinstance(trials, int) and trials > 0 else None
    except Exception as e:   # a glob over config groups needs Hydra's config loader: count as we go instead
        log.debug("live report: the sweep's jobs are not known ahead (%s)", e)
        return None


def _basic(config: Any, sweeper: Any) -> list[list[str]]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    # As BasicSweeper.sweep() does: hydra.sweeper.params first, then the command line's overrides.
    params = sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=False) if params is not None else {}
    args = [f"{k}={v}" for k, v in params.items()]
    args += [str(o) for o in OmegaConf.to_container(config.hydra.overrides.task, resolve=False)]
    overrides = OverridesParser.create().parse_overrides(args)
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
