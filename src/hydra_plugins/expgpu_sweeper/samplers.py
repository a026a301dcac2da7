"""hydra/sweeper/sampler=tpe|random|grid|cmaes|nsgaii|nsgaiii|qmc|gp|bruteforce|motpe: Optuna's samplers
for hydra/sweeper=expgpu_optuna, under the names and keys Hydra's optuna sweeper gives them, with Optuna
5's arguments. Every key is null, and a null key is not passed: the sampler's own default applies, and
another sampler named by _target_ over this one (hydra.sweeper.sampler={_target_: ..., seed: 1}, which
Hydra merges into the node) gets only the keys given. One exception: TPESampler gets constant_liar=true
unless it is set (expgpu.tune.settings.build). Optuna 4 deprecated TPE's consider_prior, prior_weight,
consider_magic_clip and consider_endpoints: set, they warn.

Hydra's optuna sweeper stores the same group. It pins optuna<3, so it never shares an environment
with expgpu's sweeper that works; where it is installed anyway, its entries are left in place (its
sweeper keeps working, and expgpu's says in one line why it cannot run).

No `from __future__ import annotations`: Hydra executes plugin modules without registering them in
sys.modules, and dataclasses cannot resolve string annotations there.
"""

import importlib.util
from dataclasses import dataclass
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class TPESamplerConf:
    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None
    n_startup_trials: Optional[int] = None
    n_ei_candidates: Optional[int] = None
    multivariate: Optional[bool] = None
    group: Optional[bool] = None
    # null: true. A running trial counts as a bad result while TPE samples: with asynchronous trials,
    # the next one is not drawn into the region a running trial already explores.
    constant_liar: Optional[bool] = None
    # Deprecated in Optuna 4 (null: not passed)
    consider_prior: Optional[bool] = None
    prior_weight: Optional[float] = None
    consider_magic_clip: Optional[bool] = None
    consider_endpoints: Optional[bool] = None
    warn_independent_sampling: Optional[bool] = None


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None


@dataclass
class GridSamplerConf:
    _target_: str = "optuna.samplers.GridSampler"
    # The grid is made from hydra.sweeper.params (choice, range, an int interval) at the sweep's start,
    # and n_trials is capped at its size, as Hydra's optuna sweeper does.
    _partial_: bool = True
    seed: Optional[int] = None


@dataclass
class CmaEsSamplerConf:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: Optional[int] = None
    x0: Optional[Dict[str, Any]] = None
    sigma0: Optional[float] = None
    n_startup_trials: Optional[int] = None
    independent_sampler: Optional[Any] = None   # {_target_: optuna.samplers.X, ...}
    warn_independent_sampling: Optional[bool] = None
    consider_pruned_trials: Optional[bool] = None
    restart_strategy: Optional[str] = None
    popsize: Optional[int] = None
    inc_popsize: Optional[int] = None
    use_separable_cma: Optional[bool] = None
    with_margin: Optional[bool] = None
    lr_adapt: Optional[bool] = None


@dataclass
class NSGAIISamplerConf:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: Optional[int] = None
    population_size: Optional[int] = None
    mutation_prob: Optional[float] = None
    crossover_prob: Optional[float] = None
    swapping_prob: Optional[float] = None
    crossover: Optional[Any] = None          # {_target_: optuna.samplers.nsgaii.X, ...}
    constraints_func: Optional[Any] = None


@dataclass
class NSGAIIISamplerConf(NSGAIISamplerConf):
    _target_: str = "optuna.samplers.NSGAIIISampler"
    dividing_parameter: Optional[int] = None


@dataclass
class QMCSamplerConf:
    _target_: str = "optuna.samplers.QMCSampler"
    seed: Optional[int] = None
    qmc_type: Optional[str] = None
    scramble: Optional[bool] = None
    independent_sampler: Optional[Any] = None
    warn_asynchronous_seeding: Optional[bool] = None
    warn_independent_sampling: Optional[bool] = None


@dataclass
class GPSamplerConf:
    _target_: str = "optuna.samplers.GPSampler"
    seed: Optional[int] = None
    n_startup_trials: Optional[int] = None
    deterministic_objective: Optional[bool] = None
    independent_sampler: Optional[Any] = None
    warn_independent_sampling: Optional[bool] = None


@dataclass
class BruteForceSamplerConf:
    _target_: str = "optuna.samplers.BruteForceSampler"
    seed: Optional[int] = None
    avoid_premature_stop: Optional[bool] = None


SAMPLERS = {
    "tpe": TPESamplerConf,
    "random": RandomSamplerConf,
    "grid": GridSamplerConf,
    "cmaes": CmaEsSamplerConf,
    "nsgaii": NSGAIISamplerConf,
    "nsgaiii": NSGAIIISamplerConf,
    "qmc": QMCSamplerConf,
    "gp": GPSamplerConf,
    "bruteforce": BruteForceSamplerConf,
    # Hydra's name for multi-objective TPE: Optuna 4 folded MOTPESampler into TPESampler
    "motpe": TPESamplerConf,
}

if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None:
    for _name, _node in SAMPLERS.items():
        ConfigStore.instance().store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="expgpu")
