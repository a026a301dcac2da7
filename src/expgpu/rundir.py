"""One run directory per run, shared by all of its ranks.

Hydra's default `outputs/${now:...}` is evaluated in each process: two srun tasks
started a second apart would write to two directories, and a requeued SLURM job
would start a fresh one and lose its checkpoint. So the directory is derived from
what the ranks of one run share: the SLURM job id, torchrun's run id (or the start
time of the torchrun agent all local workers descend from), or, for a plain run,
the time now, made unique by creating the directory atomically.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Mapping

_chosen: dict[str, str] = {}
# False when the command only prints (--cfg, --info, --help, shell completion): the name is still
# resolved, but no directory is claimed, so printing a config creates nothing.
claim = True


def _stamp(t: float) -> tuple[str, str]:
    d = _dt.datetime.fromtimestamp(t)
    return d.strftime("%Y-%m-%d"), d.strftime("%H-%M-%S")


def default_run_dir(root: str = "outputs", env: Mapping[str, str] | None = None, now: float | None = None) -> str:
    env = os.environ if env is None else env
    if env.get("EXPGPU_RUN_DIR"):
        return env["EXPGPU_RUN_DIR"]
    if env.get("SLURM_JOB_ID"):
        job = env["SLURM_JOB_ID"]
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        return f"{root}/slurm/{job}"  # the same after `scontrol requeue`
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"{root}/torchrun/{run_id}"
    if run_id == "none":
        # Standalone torchrun without --rdzv-id: all local workers share the agent,
        # whose start time is the same for each of them.
        import psutil

        day, time = _stamp(psutil.Process(os.getppid()).create_time())
        return f"{root}/{day}/{time}-torchrun{os.getppid()}"
    day, time = _stamp(now if now is not None else _dt.datetime.now().timestamp())
    base = Path(root) / day / time
    if not claim:
        return str(base)
    # Two runs started within the same second must not share a directory (and
    # resume each other's checkpoints): claim one with an atomic mkdir.
    for n in range(1000):
        candidate = base if n == 0 else base.with_name(f"{time}_{n}")
        try:
            candidate.mkdir(parents=True)
            return str(candidate)
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory under {base.parent}")


def resolver(root: str = "outputs") -> str:
    # Hydra may resolve hydra.run.dir more than once; the answer must not change.
    if root not in _chosen:
        _chosen[root] = default_run_dir(root)
    return _chosen[root]


def register() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("expgpu_run_dir"):
        OmegaConf.register_new_resolver("expgpu_run_dir", resolver)
