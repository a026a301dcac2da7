"""`hydra/sweeper=expgpu_optuna`: Optuna trials that start the moment a slot frees, pruned through
run.log, resumable by rerunning the sweep dir. The work lives in expgpu.tune (imported in sweep()).

    python -m expgpu -m hydra/sweeper=expgpu_optuna hydra/launcher=gpu_pool objective=accuracy \\
        hydra.sweeper.direction=maximize hydra.sweeper.n_trials=24 hydra/sweeper/pruner=median \\
        'task.optimizer.lr=tag(log, interval(1e-4,1e-1))'

The keys are Hydra's optuna sweeper's, plus `pruner`, so switching is one line, from any Hydra app:
the config lives here, in the ConfigStore, with its sampler and pruner groups (samplers.py, pruners.py).
No `from __future__ import annotations`: Hydra executes plugin modules without registering them in
sys.modules, and dataclasses cannot resolve string annotations there.
"""

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from omegaconf import MISSING


@dataclass
class ExpgpuOptunaConf:
    _target_: str = "hydra_plugins.expgpu_sweeper.expgpu_optuna.ExpgpuOptunaSweeper"
    # hydra/sweeper/sampler=tpe (default), random, grid, cmaes, nsgaii, nsgaiii, qmc, gp, bruteforce, motpe;
    # hydra/sweeper/pruner=median, percentile, successive_halving, hyperband, threshold, patient, nop
    defaults: List[Any] = field(default_factory=lambda: ["_self_", {"sampler": "tpe"}, {"pruner": None}])
    # The sampler and pruner are built by the sweeper (a bad _target_ is one line), not by Hydra.
    _recursive_: bool = False
    # Trials in all: those a rerun of the sweep dir finds in the study count too.
    n_trials: int = 20
    # Trials at once. null: what the launcher runs at once (gpu_pool: its GPUs over a job's, or its
    # CPU slots; slurm: hydra.launcher.array_parallelism; the basic launcher: 1; joblib: its n_jobs).
    n_jobs: Optional[int] = None
    # minimize or maximize; a list, one per value, for several objectives.
    direction: Any = "minimize"
    # null: the sweep dir's path. A study of that name found in the storage is continued.
    study_name: Optional[str] = None
    # null: an Optuna journal file in the sweep dir (SWEEP_DIR/optuna.journal), which jobs on other
    # nodes reach through a shared file system; or any Optuna storage URL (sqlite:///study.db, ...).
    storage: Optional[str] = None
    # Any Optuna sampler: its _target_ and its arguments (seed: the study's proposals repeat).
    sampler: Any = MISSING
    # Any Optuna pruner, or null: no pruning. It judges what run.log wrote for the objective.
    pruner: Any = None
    # The search space in Hydra's sweep syntax: {key: interval(a,b) | tag(log, interval(a,b)) |
    # choice(...) | range(a,b[,s])}; sweeps on the command line join it, and a plain value there
    # (key=value) takes its key out of it.
    params: Optional[Dict[str, Any]] = field(default_factory=dict)
    # Deprecated (Hydra 1.2): {key: {type: int|float|categorical, low, high, step, log, choices}};
    # read with a warning, unless params has entries too.
    search_space: Optional[Dict[str, Any]] = None
    # The dotted path of fn(cfg, trial) suggesting more parameters (Optuna's define-by-run).
    custom_search_space: Optional[str] = None
    # Stop the search (exit 1) when more than this fraction of the last n_jobs trials failed.
    max_failure_rate: float = 0.0


ConfigStore.instance().store(group="hydra/sweeper", name="expgpu_optuna", node=ExpgpuOptunaConf,
                             provider="expgpu")


class ExpgpuOptunaSweeper(Sweeper):
    def __init__(self, **params: Any) -> None:
        from expgpu.errors import exit_on_user_error
        from expgpu.schema import refuse_added_keys

        with exit_on_user_error():   # a key added with + (+hydra.sweeper.trials=5): one line, exit 2
            refuse_added_keys(params, ExpgpuOptunaConf, "hydra.sweeper.")
        self.params = params
        self.config = None
        self.launcher = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        from hydra.core.plugins import Plugins

        from expgpu.tune.check import TrialChecked

        self.config = config
        # Each job checks, before the task runs, that it composed the parameters its trial records.
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=TrialChecked(task_function))

    def sweep(self, arguments: List[str]) -> None:
        from expgpu.errors import exit_on_user_error
        from expgpu.tune.sweep import SweepFailed, sweep

        # Any Hydra app, not only `python -m expgpu`: what ends the sweep is one line, never Hydra's
        # report with a traceback (SystemExit passes through Hydra's run_and_report).
        # slurm_pool from a command line: the study runs inside the allocation, not here (in-process, the
        # trials go to it a batch at a time)
        if hasattr(self.launcher, "take_over") and self.launcher.can_take_over():
            self.launcher.take_over()
        with exit_on_user_error():
            try:
                return sweep(self.params, self.config, self.launcher, arguments)
            except SweepFailed as e:
                print(f"expgpu: {e}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            except KeyboardInterrupt:
                print("expgpu: interrupted", file=sys.stderr, flush=True)
                raise SystemExit(130) from None
