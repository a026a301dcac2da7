"""hydra.sweeper.* of expgpu_optuna, checked: one line naming a bad key and what it allows (exit 2).

The keys are Hydra's optuna sweeper's (n_trials, n_jobs, direction, study_name, storage, sampler,
params, custom_search_space, max_failure_rate), plus pruner; the metric is the root `objective`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from expgpu.errors import UserError, first_line

DIRECTIONS = ("minimize", "maximize")


@dataclass(frozen=True)
class Settings:
    n_trials: int
    n_jobs: int | None            # None: as many as the launcher runs at once
    directions: tuple[str, ...]
    objective: tuple[str, ...]    # the metric(s) the jobs return, one per direction
    study_name: str | None
    storage: str | None
    sampler: dict | None          # {_target_: ..., seed: ...}; None: Optuna's default (TPE)
    pruner: dict | None           # {_target_: ...}; None: no pruning
    params: dict | None
    custom_search_space: str | None
    max_failure_rate: float


def check(params: Mapping[str, Any], objective: Any) -> Settings:
    p = {k: _plain(v) for k, v in params.items()}
    n_trials, n_jobs = _whole(p, "n_trials", False), _whole(p, "n_jobs", True)
    direction = p.get("direction", "minimize")
    directions = tuple(direction) if isinstance(direction, (list, tuple)) else (direction,)
    for d in directions:
        if d not in DIRECTIONS:
            raise UserError(f"hydra.sweeper.direction={direction!r} is not allowed: minimize or maximize, "
                            "or a list of them (one per objective)")
    names = _objective(objective)
    if len(names) != len(directions):
        raise UserError(f"objective={list(names)} names {len(names)} metric(s) but hydra.sweeper.direction="
                        f"{list(directions)} has {len(directions)}: give one direction per objective")
    pruner = _target(p, "pruner")
    if pruner is not None and len(names) > 1:
        raise UserError("hydra.sweeper.pruner: Optuna prunes single-objective studies only; with several "
                        "objectives leave hydra.sweeper.pruner null")
    rate = p.get("max_failure_rate", 1.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise UserError(f"hydra.sweeper.max_failure_rate={rate!r} is not allowed: a fraction from 0 to 1")
    space = p.get("params")
    if space is not None and not isinstance(space, dict):
        raise UserError(f"hydra.sweeper.params={space!r} is not allowed: a mapping of keys to sweep expressions")
    custom = p.get("custom_search_space")
    if custom is not None and not isinstance(custom, str):
        raise UserError(f"hydra.sweeper.custom_search_space={custom!r} is not allowed: the dotted path of a "
                        "function (cfg, trial) -> None, or null")
    return Settings(n_trials, n_jobs, directions, names, p.get("study_name"), p.get("storage"),
                    _target(p, "sampler"), pruner, space, custom, float(rate))


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _whole(p: Mapping[str, Any], key: str, none_ok: bool) -> int | None:
    value = p.get(key)
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"hydra.sweeper.{key}={value!r} is not allowed: an integer >= 1"
                        + (" or null (as many as the launcher runs at once)" if none_ok else ""))
    return value


def _objective(objective: Any) -> tuple[str, ...]:
    objective = _plain(objective)
    names = [objective] if isinstance(objective, str) else objective
    if not names or not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"objective={objective!r}: hydra/sweeper=expgpu_optuna needs the metric to optimize, "
                        "e.g. objective=accuracy (a metric the task returns), or a list of them")
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
    arguments."""
    if node is None:
        return None
    from hydra.utils import instantiate

    target = node["_target_"]
    try:
        made = instantiate(node, _convert_="all")
    except Exception as e:
        cause = e.__cause__ or e
        args = ", ".join(f"{k}={v!r}" for k, v in node.items() if k != "_target_")
        why = "cannot be imported" if isinstance(cause, (ImportError, AttributeError)) else \
            f"does not take ({args})" if isinstance(cause, TypeError) else "could not be made"
        raise UserError(f"hydra.sweeper.{key}._target_={target}: {why} ({_said(cause)}); allowed: an "
                        f"Optuna {key} class, e.g. optuna.{key}s.{'TPESampler' if key == 'sampler' else 'MedianPruner'}, "
                        "with its own arguments") from None
    import optuna

    kind = optuna.samplers.BaseSampler if key == "sampler" else optuna.pruners.BasePruner
    if not isinstance(made, kind):
        raise UserError(f"hydra.sweeper.{key}._target_={target} made a {type(made).__name__}, not an Optuna "
                        f"{key}; allowed: a subclass of {kind.__module__.split('._')[0]}.{kind.__name__}")
    return made


def _said(e: BaseException) -> str:
    """An error's whole message on one line, short (Hydra's 'Error loading X:' puts the cause on line 2)."""
    return " ".join(str(e).split())[:240] or first_line(e)
