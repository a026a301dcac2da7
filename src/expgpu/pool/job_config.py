"""A job's composed config read in the launcher's process (resolved, checked, its dir computed) as the job
will read it.

A `${hydra:job.num}` or `${hydra:runtime.output_dir}` in a job's config (`task.seed=${hydra:job.num}`, a
script's `--out ${hydra:runtime.output_dir}`) reads HydraConfig, which Hydra's run_job sets to the job's own
config in the job, with hydra.job.num, hydra.job.id and hydra.runtime.output_dir filled in. A launcher's process
has no HydraConfig (or one of another config), so it could not check such a job before its start. Here a read
is tried first as is; only where it fails, it is tried again with HydraConfig set to the job's config, and what
run_job fills in of its hydra node filled in for that read (the config is the same after it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def in_job(cfg, read: Callable[[Any], T]) -> T:
    """read(cfg) where every `${hydra:...}` in cfg resolves as it will in the job. cfg: a job's composed config
    with hydra.job.num set (the launchers set it as run_job will). read's error, if it fails both ways, is the
    one it raised with the job's HydraConfig."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.instance()
    saved = hc.cfg
    try:
        hc.cfg = None   # unset: a ${hydra:...} fails, rather than read the launcher's own config
        try:
            return read(cfg)
        except Exception:
            # cfg itself as HydraConfig: what HydraConfig.get() returns is its hydra node, as after run_job's
            # set_config, without that call's copy of the node (~6 ms)
            hc.cfg = cfg
            with _filled_in(cfg):
                return read(cfg)
    finally:
        hc.cfg = saved


def resolved(cfg, key: str):
    """cfg[key] as a plain dict (resolved, enums as strings), as the job will resolve it."""
    from omegaconf import OmegaConf

    return in_job(cfg, lambda c: OmegaConf.to_container(c[key], resolve=True, enum_to_str=True))


def job_dir(cfg) -> Path:
    """The job dir as run_job will compute it (hydra.sweep.dir / hydra.sweep.subdir), so that a launcher knows
    it ahead; a subdir like ${hydra:job.override_dirname} reads the job's HydraConfig."""
    return in_job(cfg, _sweep_dir)


def _sweep_dir(cfg) -> Path:
    from omegaconf import OmegaConf

    return Path(str(OmegaConf.select(cfg, "hydra.sweep.dir"))) / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))


@contextlib.contextmanager
def _filled_in(cfg):
    """What run_job fills in of the job's hydra node that the launcher leaves missing, filled in for a while:
    hydra.job.id where the launcher does not know it yet (a SLURM job's id: Hydra's submitit launcher's own
    stand-in until submitit knows it), and hydra.runtime.output_dir. Missing again after."""
    from omegaconf import MISSING, OmegaConf, open_dict, read_write

    hydra, filled = cfg.hydra, []
    try:
        with read_write(hydra), open_dict(hydra):
            if OmegaConf.is_missing(hydra.job, "id") and not OmegaConf.is_missing(hydra.job, "num"):
                hydra.job.id = f"job_id_for_{hydra.job.num}"
                filled.append((hydra.job, "id"))
            if OmegaConf.is_missing(hydra.runtime, "output_dir"):
                try:   # the subdir may read what is set so far (${hydra:job.num})
                    hydra.runtime.output_dir = os.path.abspath(_sweep_dir(cfg))
                    filled.append((hydra.runtime, "output_dir"))
                except Exception:   # a subdir that cannot resolve: the read that needs it says so
                    pass
        yield
    finally:
        with read_write(hydra), open_dict(hydra):
            for node, key in filled:
                node[key] = MISSING
