"""hydra/sweeper/pruner=median|percentile|successive_halving|hyperband|threshold|patient|nop: Optuna's
pruners for hydra/sweeper=expgpu_optuna (Hydra's optuna sweeper has no pruning). A pruner judges what
the trial's run.log wrote for the objective, at run.log's steps; any other pruner by its _target_:
hydra.sweeper.pruner={_target_: optuna.pruners.WilcoxonPruner, p_threshold: 0.05}.

No `from __future__ import annotations` (see samplers.py).
"""

from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class MedianPrunerConf:
    # Prune a trial whose objective at a step is worse than the median of earlier trials' at that step.
    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 5     # no pruning until this many trials have finished
    n_warmup_steps: int = 0       # no pruning of a trial before this step
    interval_steps: int = 1
    n_min_trials: int = 1         # trials that must have reported at a step before it is judged


@dataclass
class PercentilePrunerConf:
    # Prune a trial whose objective at a step is in the worst `percentile` % of earlier trials' there.
    _target_: str = "optuna.pruners.PercentilePruner"
    percentile: float = 25.0
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    interval_steps: int = 1
    n_min_trials: int = 1


@dataclass
class SuccessiveHalvingPrunerConf:
    # Asynchronous successive halving (ASHA): at each rung (min_resource x reduction_factor^k steps)
    # only the best 1/reduction_factor of the trials that reached it go on.
    _target_: str = "optuna.pruners.SuccessiveHalvingPruner"
    min_resource: Any = "auto"
    reduction_factor: int = 4
    min_early_stopping_rate: int = 0
    bootstrap_count: int = 0


@dataclass
class HyperbandPrunerConf:
    # Several successive-halving brackets with different minimum resources (steps).
    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: int = 1
    max_resource: Any = "auto"
    reduction_factor: int = 3
    bootstrap_count: int = 0


@dataclass
class ThresholdPrunerConf:
    # Prune a trial whose objective leaves [lower, upper] (or is NaN).
    _target_: str = "optuna.pruners.ThresholdPruner"
    lower: Optional[float] = None
    upper: Optional[float] = None
    n_warmup_steps: int = 0
    interval_steps: int = 1


@dataclass
class PatientPrunerConf:
    # Prune only after the objective has not improved by min_delta for `patience` reports, and then
    # only if wrapped_pruner ({_target_: optuna.pruners.X, ...}, or null) says so.
    _target_: str = "optuna.pruners.PatientPruner"
    wrapped_pruner: Optional[Any] = None
    patience: int = MISSING
    min_delta: float = 0.0


@dataclass
class NopPrunerConf:
    _target_: str = "optuna.pruners.NopPruner"


PRUNERS = {
    "median": MedianPrunerConf,
    "percentile": PercentilePrunerConf,
    "successive_halving": SuccessiveHalvingPrunerConf,
    "hyperband": HyperbandPrunerConf,
    "threshold": ThresholdPrunerConf,
    "patient": PatientPrunerConf,
    "nop": NopPrunerConf,
}

for _name, _node in PRUNERS.items():
    ConfigStore.instance().store(group="hydra/sweeper/pruner", name=_name, node=_node, provider="expgpu")
