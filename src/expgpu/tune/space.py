"""The search space: Hydra's sweep syntax -> Optuna distributions, and a trial -> its job's overrides.

    hydra.sweeper.params:  {task.optimizer.lr: tag(log, interval(1e-4, 1e-1)), task.batch_size: choice(16, 32, 64),
                            task.model.hidden: range(32, 257, 32)}

and sweeps on the command line (`'task.optimizer.lr=interval(1e-4,1e-1)'`, `task=a,b`) are parameters too,
as with Hydra's optuna sweeper; plain command-line overrides (`task=b`) go to every trial as they are.
interval() is a float (an int between two ints), tag(log, ...) samples it on a log scale, choice() and a
comma list are categorical, range() is an int (a float with a float bound) with its step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from expgpu.errors import UserError

ALLOWED = "interval(a,b), tag(log, interval(a,b)), choice(x,y,...), range(start,stop[,step]) or a comma list"


@dataclass
class Space:
    distributions: dict[str, Any] = field(default_factory=dict)   # name -> optuna distribution
    fixed: list[str] = field(default_factory=list)                # overrides every trial gets as they are

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """A trial's overrides: its parameters (in the space's order, then custom ones), then the fixed ones."""
        return [f"{name}={_spelled(value)}" for name, value in params.items()] + self.fixed


def parse(params: dict[str, str] | None, arguments: list[str]) -> Space:
    """`params` (each must be a sweep) and the command line's overrides (sweeps or plain)."""
    space = Space()
    for name, expr in (params or {}).items():
        text = f"{name}={expr}"
        override = _parse_one(text, f"hydra.sweeper.params.{name}={expr}")
        if not override.is_sweep_override():
            raise UserError(f"hydra.sweeper.params.{name}={expr} is not a sweep expression; allowed: {ALLOWED} "
                            "(a fixed value goes on the command line)")
        space.distributions[name] = _distribution(override, f"hydra.sweeper.params.{name}={expr}")
    for text in arguments:
        override = _parse_one(text, text)
        if override.is_sweep_override() and not override.is_delete():
            space.distributions[override.get_key_element()] = _distribution(override, text)
        else:
            space.fixed.append(text)
    return space


def _parse_one(text: str, shown: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides([text])[0]
    except OverrideParseException as e:
        raise UserError(f"{shown}: not a sweep expression Hydra can read ({' '.join(str(e).split())[:200]}); "
                        f"allowed: {ALLOWED}") from None


def _distribution(override, shown: str):
    value = override.value()
    try:
        return _made(override, value)
    except ValueError as e:   # a log scale at or below 0, bounds the wrong way round, a step of 0
        raise UserError(f"{shown}: {' '.join(str(e).split())}; allowed: {ALLOWED}") from None


def _made(override, value):
    from hydra.core.override_parser.types import Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        choices = list(override.sweep_iterator(transformer=Transformer.encode))
        return CategoricalDistribution(choices)
    if override.is_range_sweep():
        if any(isinstance(v, float) for v in (value.start, value.stop, value.step)):
            return FloatDistribution(float(value.start), float(value.stop), step=float(value.step))
        # range(a, b, s) excludes b, as Python's (and Hydra's basic sweeper's) does
        return IntDistribution(int(value.start), int(value.stop) - 1, step=int(value.step))
    if override.is_interval_sweep():
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise ValueError("this kind of sweep cannot be sampled")


def _spelled(value: Any) -> str:
    """A sampled value as a Hydra override's value (a string that would read as another type is quoted)."""
    if isinstance(value, str):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            parsed = OverridesParser.create().parse_overrides([f"k={value}"])[0].value()
        except Exception:
            parsed = None
        return value if parsed == value else "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else repr(value)
