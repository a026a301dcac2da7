"""The search space: Hydra's sweep syntax -> Optuna distributions, and a trial -> its job's overrides.

    hydra.sweeper.params:  {task.optimizer.lr: tag(log, interval(1e-4, 1e-1)), task.batch_size: choice(16, 32, 64),
                            task.model.hidden: range(32, 256, 32)}

Sweeps on the command line (`'task.optimizer.lr=interval(1e-4,1e-1)'`, `task=a,b`) are parameters too, and
win over `params`; a plain value there (`y=0`, `+y=0`) goes to every trial as it is and takes its key out
of the search, as with Hydra's optuna sweeper: the study never records a value that the job would not run.

One rule for the bounds, Hydra's optuna sweeper's: both ends are in. interval(a, b) is a float in [a, b]
(an int between two ints, as is int(interval(a, b))), tag(log, ...) samples it on a log scale; range(a, b[, s])
is a, a+s, ... up to and including b (a float when a bound or the step is one); choice() and a comma
list are categorical (so is shuffle(range(...)), whose values are Hydra's: b not among them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from expgpu.errors import UserError

ALLOWED = "interval(a,b), tag(log, interval(a,b)), choice(x,y,...), range(start,stop[,step]) or a comma list"


@dataclass
class Space:
    distributions: dict[str, Any] = field(default_factory=dict)   # name -> optuna distribution
    fixed: list[str] = field(default_factory=list)                # overrides every trial gets as they are
    taken_out: list[str] = field(default_factory=list)            # searched keys fixed on the command line

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """A trial's overrides: its parameters (in the space's order, then custom ones), then the fixed ones."""
        return [f"{name}={_spelled(value)}" for name, value in params.items()] + self.fixed


def parse(params: dict[str, Any] | None, arguments: list[str]) -> Space:
    """`params` (sweeps, plain values, or the deprecated search_space's mappings), then the command
    line's overrides (sweeps or plain)."""
    space, fixed_names = Space(), {}
    for name, expr in (params or {}).items():
        shown = f"hydra.sweeper.params.{name}={expr}"
        if isinstance(expr, dict):   # hydra.sweeper.search_space's form
            space.distributions[name] = _from_mapping(expr, f"hydra.sweeper.search_space.{name}")
            continue
        override = _parse_one(f"{name}={_written(expr)}", shown)
        if override.is_sweep_override():
            space.distributions[name] = _distribution(override, shown)
        else:
            space.fixed.append(f"{name}={_written(expr)}")
            fixed_names[_bare(override)] = name
    for text in arguments:
        override = _parse_one(text, text)
        if override.is_sweep_override() and not override.is_delete():
            _drop(space.distributions, _bare(override))
            space.distributions[override.get_key_element()] = _distribution(override, text)
        else:
            space.fixed.append(text)
            fixed_names[_bare(override)] = text
    for bare, text in fixed_names.items():
        if _drop(space.distributions, bare):
            space.taken_out.append(text)
    return space


def grid_of(space: Space) -> dict[str, list]:
    """GridSampler's search space: every value of each parameter, under the same rule as sampling;
    a continuous one is one line."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    grid = {}
    for name, d in space.distributions.items():
        if isinstance(d, CategoricalDistribution):
            grid[name] = list(d.choices)
        elif isinstance(d, (IntDistribution, FloatDistribution)) and d.step is not None and not d.log:
            n = int(round((d.high - d.low) / d.step))
            grid[name] = [d.low + i * d.step for i in range(n + 1)]
            if isinstance(d, FloatDistribution):
                grid[name] = [round(v, 12) for v in grid[name]]
        else:
            raise UserError(f"hydra/sweeper/sampler=grid: {name} is sampled from a continuous (or log) interval, "
                            f"which has no grid; give it as choice(...) or range(a,b,step)")
    return grid


def _bare(override) -> str:
    """The key an override sets, without +, ++ or ~ (`+y=0` fixes what `y` searches)."""
    key = override.key_or_group
    return key if override.package is None else f"{key}@{override.package}"


def _drop(distributions: dict, bare: str) -> bool:
    names = [n for n in distributions if n.lstrip("+") == bare]
    for n in names:
        del distributions[n]
    return bool(names)


def _written(expr: Any) -> str:
    """A params value as override text (YAML may have made it a number or a boolean already)."""
    if isinstance(expr, bool):
        return str(expr).lower()
    return "null" if expr is None else str(expr)


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
        if not value.step > 0 or value.stop < value.start:
            raise ValueError(f"range({value.start}, {value.stop}, {value.step}) needs start <= stop and a step > 0")
        # both ends in, as Hydra's optuna sweeper; the top snapped down onto the step's grid
        n = math.floor((value.stop - value.start) / value.step + 1e-9)
        if any(isinstance(v, float) for v in (value.start, value.stop, value.step)):
            step = float(value.step)
            return FloatDistribution(float(value.start), round(float(value.start) + n * step, 12), step=step)
        return IntDistribution(int(value.start), int(value.start) + n * int(value.step), step=int(value.step))
    if override.is_interval_sweep():
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise ValueError("this kind of sweep cannot be sampled")


def _from_mapping(node: dict, shown: str):
    """One entry of the deprecated search_space: {type: int|float|categorical, low, high, step, log, choices}."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    kind = str(node.get("type", "")).split(".")[-1]
    try:
        if kind == "categorical":
            return CategoricalDistribution(list(node["choices"]))
        low, high, step, log = node["low"], node["high"], node.get("step"), bool(node.get("log", False))
        if kind == "int":
            return IntDistribution(int(low), int(high), log=log, step=1 if step is None else int(step))
        if kind == "float":
            return FloatDistribution(float(low), float(high), log=log, step=None if step is None else float(step))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{shown}={node}: {' '.join(str(e).split()) or type(e).__name__}; allowed: {{type: int|float"
                        "|categorical, low, high, step, log, choices}, or better a sweep expression in "
                        f"hydra.sweeper.params ({ALLOWED})") from None
    raise UserError(f"{shown}.type={node.get('type')!r} is not allowed: int, float or categorical")


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
