"""`hydra/sweeper=expgpu_optuna`: Optuna trials that start the moment a slot frees, pruned through
run.log, resumable by rerunning the sweep dir. The work lives in expgpu.tune (imported in sweep()).

    python -m expgpu -m hydra/sweeper=expgpu_optuna hydra/launcher=gpu_pool objective=accuracy \\
        hydra.sweeper.direction=maximize hydra.sweeper.n_trials=24 hydra/sweeper/pruner=median \\
        'task.optimizer.lr=tag(log, interval(1e-4,1e-1))'

The keys are Hydra's optuna sweeper's, plus `pruner`, so switching is one line. No
`from __future__ import annotations`: Hydra executes plugin modules without registering them in
sys.modules, and dataclasses cannot resolve string annotations there.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper


@dataclass
class ExpgpuOptunaConf:
    _target_: str = "hydra_plugins.expgpu_sweeper.expgpu_optuna.ExpgpuOptunaSweeper"
    # The sampler and pruner are built by the sweeper (a bad _target_ is one line), not by Hydra.
    _recursive_: bool = False
    # Trials in all: those a rerun of the sweep dir finds in the study count too.
    n_trials: int = 20
    # Trials at once. null: what the launcher runs at once (gpu_pool: its GPUs over a job's, or its
    # CPU slots; slurm: hydra.launcher.array_parallelism; the basic launcher: 1; joblib: its n_jobs).
    n_jobs: Optional[int] = None
    # minimize or maximize the root `objective` metric; a list, one per metric, for several objectives.
    direction: Any = "minimize"
    # null: the sweep dir's path. A study of that name found in the storage is continued.
    study_name: Optional[str] = None
    # null: an Optuna journal file in the sweep dir (SWEEP_DIR/optuna.journal), which jobs on other
    # nodes reach through a shared file system; or any Optuna storage URL (sqlite:///study.db, ...).
    storage: Optional[str] = None
    # Any Optuna sampler: its _target_ and its arguments (seed: the study's proposals repeat).
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None})
    # Any Optuna pruner (hydra/sweeper/pruner=median|successive_halving|hyperband|percentile, or a
    # _target_ of your own); null: no pruning. It judges what run.log wrote for the objective.
    pruner: Any = None
    # The search space in Hydra's sweep syntax: {key: interval(a,b) | tag(log, interval(a,b)) |
    # choice(...) | range(a,b[,s])}; sweeps on the command line join it.
    params: Dict[str, str] = field(default_factory=dict)
    # The dotted path of fn(cfg, trial) suggesting more parameters (Optuna's define-by-run).
    custom_search_space: Optional[str] = None
    # Kept for Hydra's optuna sweeper's configs; a failed trial is FAILED in the study and the search goes on.
    max_failure_rate: float = 1.0


ConfigStore.instance().store(name="expgpu_optuna_sweeper_schema", node=ExpgpuOptunaConf, provider="expgpu")


class ExpgpuOptunaSweeper(Sweeper):
    def __init__(self, **params: Any) -> None:
        self.params = params
        self.config = None
        self.launcher = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(config=config, hydra_context=hydra_context,
                                                                task_function=task_function)

    def sweep(self, arguments: List[str]) -> None:
        from expgpu.tune.sweep import sweep

        return sweep(self.params, self.config, self.launcher, arguments)
