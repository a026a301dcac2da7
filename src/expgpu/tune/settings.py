"""hydra.sweeper.* of expgpu_optuna, checked: one line naming a bad key and what it allows (exit 2).

The keys are Hydra's optuna sweeper's (n_trials, n_jobs, direction, study_name, storage, sampler,
params, search_space, custom_search_space, max_failure_rate), plus pruner. The objective is what the
task returns (a number, or one per direction); the root `objective` names the metric(s) to take from
a task that returns a dict (every `python -m expgpu` task does).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from expgpu.errors import UserError, first_line, shown

DIRECTIONS = ("minimize", "maximize")
# Below this, expgpu_optuna does not run (FloatDistribution, ask/tell with fixed distributions,
# JournalFileBackend); hydra-optuna-sweeper's optuna<3 pin is how an older one usually arrives.
OPTUNA_NEEDED = (5, 0)


@dataclass(frozen=True)
class Settings:
    n_trials: int
    n_jobs: int | None            # None: as many as the launcher runs at once
    directions: tuple[str, ...]
    objective: tuple[str, ...] | None   # the metric(s) taken from a returned dict; None: the value itself
    study_name: str | None
    storage: str | None
    sampler: dict | None          # {_target_: ..., seed: ...}; None: Optuna's default (TPE)
    pruner: dict | None           # {_target_: ...}; None: no pruning
    params: dict | None
    custom_search_space: str | None
    max_failure_rate: float

    @property
    def metric(self) -> str | None:
        """The one metric a pruner judges in run.log's rows (None: several, or none named)."""
        return self.objective[0] if self.objective and len(self.objective) == 1 else None


def check_optuna() -> None:
    """One line when Optuna is missing or older than expgpu_optuna needs (before anything imports it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("optuna")
    except PackageNotFoundError:
        raise UserError("hydra/sweeper=expgpu_optuna needs Optuna (optuna>=5.0), which is not installed: "
                        "pip install 'expgpu[tune]'") from None
    parts = tuple(int(p) for p in (have.split(".") + ["0"])[:2] if p.isdigit())
    if parts < OPTUNA_NEEDED:
        raise UserError(f"optuna {have} is installed, but hydra/sweeper=expgpu_optuna needs optuna>=5.0 "
                        "(pip install 'optuna>=5'); hydra-optuna-sweeper pins optuna<3, so Hydra's optuna "
                        "sweeper and expgpu's cannot share one environment: uninstall hydra-optuna-sweeper, or "
                        "use it with hydra/sweeper=optuna")


def check(params: Mapping[str, Any], objective: Any) -> Settings:
    p = {k: _plain(v) for k, v in params.items()}
    n_trials, n_jobs = _whole(p, "n_trials", False), _whole(p, "n_jobs", True)
    direction = p.get("direction", "minimize")
    directions = tuple(direction) if isinstance(direction, (list, tuple)) else (direction,)
    directions = tuple(getattr(d, "name", d) for d in directions)   # Hydra's Direction enum, as its configs hold it
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise UserError(f"hydra.sweeper.direction={direction!r} is not allowed: minimize or maximize, "
                        "or a list of them (one per objective)")
    names = _objective(objective)
    if names is not None and len(names) != len(directions):
        raise UserError(f"objective={list(names)} names {len(names)} metric(s) but hydra.sweeper.direction="
                        f"{list(directions)} has {len(directions)}: give one direction per objective")
    pruner = _target(p, "pruner")
    if pruner is not None and len(directions) > 1:
        raise UserError("hydra.sweeper.pruner: Optuna prunes single-objective studies only; with several "
                        "objectives leave hydra.sweeper.pruner null")
    rate = p.get("max_failure_rate", 0.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise UserError(f"hydra.sweeper.max_failure_rate={rate!r} is not allowed: a fraction from 0 to 1 (the "
                        "share of the last n_jobs trials that may fail before the search stops)")
    space = _space(p)
    custom = p.get("custom_search_space")
    if custom is not None and not isinstance(custom, str):
        raise UserError(f"hydra.sweeper.custom_search_space={custom!r} is not allowed: the dotted path of a "
                        "function (cfg, trial) -> None, or null")
    return Settings(n_trials, n_jobs, directions, names, _study_name(p), p.get("storage"),
                    _target(p, "sampler"), pruner, space, custom, float(rate))


def _study_name(p: Mapping[str, Any]) -> str | None:
    name = p.get("study_name")
    if isinstance(name, int) and not isinstance(name, bool):   # study_name=2024, as Hydra reads it
        name = str(name)
    if name is not None and not (isinstance(name, str) and name.strip()):
        raise UserError(f"hydra.sweeper.study_name={name!r} is not allowed: a name, or null (the sweep dir's path, "
                        "so that a rerun into it continues the study)")
    return name


def _space(p: Mapping[str, Any]) -> dict | None:
    """`params`, or the deprecated `search_space` (with Hydra's warnings), as {key: sweep expression or
    Hydra's distribution mapping}."""
    params, old = p.get("params"), p.get("search_space")
    for key, value in (("params", params), ("search_space", old)):
        if value is not None and not isinstance(value, dict):
            raise UserError(f"hydra.sweeper.{key}={shown(value)} is not allowed: a mapping of keys to sweep "
                            "expressions")
    url = "https://hydra.cc/docs/upgrades/1.1_to_1.2/changes_to_sweeper_config/"
    if old is None:
        return params
    if params:
        warnings.warn("Both hydra.sweeper.params and hydra.sweeper.search_space are configured.\n"
                      f"Hydra will use hydra.sweeper.params for defining search space.\n{url}")
        return params
    from hydra._internal.deprecation_warning import deprecation_warning

    deprecation_warning(message="`hydra.sweeper.search_space` is deprecated and will be removed in the next major "
                                f"release.\nPlease configure with `hydra.sweeper.params`.\n{url}")
    return old


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _whole(p: Mapping[str, Any], key: str, none_ok: bool) -> int | None:
    value = p.get(key)
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"hydra.sweeper.{key}={shown(value)} is not allowed: an integer >= 1"
                        + (" or null (as many as the launcher runs at once)" if none_ok else ""))
    return value


def _objective(objective: Any) -> tuple[str, ...] | None:
    objective = _plain(objective)
    if objective is None:
        return None
    names = [objective] if isinstance(objective, str) else objective
    if not names or not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"objective={objective!r} is not allowed: the name of a metric the task returns in a dict "
                        "(e.g. objective=accuracy), a list of them (one per direction), or null (the task "
                        "returns the value itself)")
    return tuple(names)


def _target(p: Mapping[str, Any], key: str) -> dict | None:
    node = p.get(key)
    if node is None:
        return None
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
        raise UserError(f"hydra.sweeper.{key}={node!r} is not allowed: {{_target_: optuna.{key}s.X, ...}} or null")
    return node


def build(node: dict | None, key: str):
    """The sampler or pruner `node` names, or None; one line when it does not import or takes other
    arguments. A key set to null is not passed (the class's own default applies). GridSampler's
    config is a `_partial_` one, as in Hydra's optuna sweeper: it comes back as a partial, for the
    sweep to give it the grid made from the search space (grid_of)."""
    if node is None:
        return None
    from hydra.utils import instantiate

    target = node["_target_"]
    given = {k: v for k, v in node.items() if v is not None or k.startswith("_")}
    if key == "sampler" and target.rsplit(".", 1)[-1] == "TPESampler":
        # asynchronous trials: TPE treats the running ones as bad results instead of sampling their
        # region again (Optuna 5's default too; said here so that it holds whatever Optuna's becomes)
        given.setdefault("constant_liar", True)
    try:
        made = instantiate(given, _convert_="all")
    except Exception as e:
        cause = e.__cause__ or e
        args = ", ".join(f"{k}={v!r}" for k, v in given.items() if not k.startswith("_"))
        why = "cannot be imported" if isinstance(cause, (ImportError, AttributeError)) else \
            f"does not take ({args})" if isinstance(cause, TypeError) else "could not be made"
        raise UserError(f"hydra.sweeper.{key}._target_={target}: {why} ({_said(cause)}); allowed: an "
                        f"Optuna {key} class, e.g. optuna.{key}s."
                        f"{'TPESampler' if key == 'sampler' else 'MedianPruner'}, "
                        "with its own arguments") from None
    import optuna

    kind = optuna.samplers.BaseSampler if key == "sampler" else optuna.pruners.BasePruner
    if isinstance(made, functools.partial):
        if key == "sampler" and isinstance(made.func, type) and issubclass(made.func, optuna.samplers.GridSampler):
            return made
        raise UserError(f"hydra.sweeper.{key}._partial_=true: only GridSampler's config is partial (the sweep "
                        f"gives it the grid); {target} is made whole: drop _partial_")
    if not isinstance(made, kind):
        raise UserError(f"hydra.sweeper.{key}._target_={target} made a {type(made).__name__}, not an Optuna "
                        f"{key}; allowed: a subclass of {kind.__module__.split('._')[0]}.{kind.__name__}")
    return made


def _said(e: BaseException) -> str:
    """An error's whole message on one line, short (Hydra's 'Error loading X:' puts the cause on line 2)."""
    return " ".join(str(e).split())[:240] or first_line(e)
