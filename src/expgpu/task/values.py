"""A task key's value checked against, and converted to, what the task function declares: its parameters'
annotations (int, float, bool, str, Literal, Enum, and lists, tuples and dicts of them), or the fields of the one
dataclass it takes its parameters as (a config object, nested dataclasses built from their mappings)."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from typing import Any, Callable

from expgpu.errors import UserError, first_line, shown

SIMPLE = (int, float, bool, str)


def config_object(named: dict[str, inspect.Parameter], hints: dict[str, Any], given: dict) -> tuple[str, Any] | None:
    """(name, dataclass or dict) when the function takes one parameter besides the run, annotated
    with a dataclass or a mapping type, and the task file does not set that name itself: the task
    keys are then that object's fields (a script's config block stays as it is)."""
    from collections.abc import Mapping

    if len(named) != 1:
        return None
    (name, _), = named.items()
    ann = hints.get(name)
    if name in given or ann is None:
        return None
    if isinstance(ann, type) and dataclasses.is_dataclass(ann):
        return name, ann
    return (name, dict) if (typing.get_origin(ann) or ann) in (dict, Mapping) else None


def type_name(cls: Any) -> str:
    return getattr(cls, "__name__", str(cls))


def check_fields(cls: Any, given: dict, whose: str, prefix: str = "task.") -> dict:
    """The task keys checked against the config object's fields and converted to their annotations;
    a nested dataclass field takes a mapping, checked alike. A dict takes every key as given."""
    if cls is dict:
        return dict(given)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    try:
        hints = typing.get_type_hints(cls)
    except Exception:   # an annotation that does not evaluate: values pass as given
        hints = {}
    out = {}
    for key, value in given.items():
        if key not in fields:
            raise UserError(f"{prefix}{key}: {whose} has no field {key!r}{did_you_mean(key, given, fields, prefix)}; "
                            f"its fields: {', '.join(fields)}")
        ann = hints.get(key)
        if isinstance(ann, type) and dataclasses.is_dataclass(ann) and isinstance(value, dict):
            out[key] = check_fields(ann, value, f"{type_name(cls)}.{key}: {type_name(ann)}", f"{prefix}{key}.")
        else:
            out[key] = coerce(f"{prefix[len('task.'):]}{key}", value, ann)
    for name, f in fields.items():
        if name not in given and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"{prefix}{name}: {whose} needs it (a field without a default); "
                            f"set it in the task file or as {prefix}{name}=...")
    return out


def field_defaults(cls: Any) -> dict:
    """The config object's plain defaults, which belong to the run's identity as a function's do."""
    if cls is dict:
        return {}
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING and plain(f.default)}


def built_object(cls: Any, values: dict) -> Any:
    """The config object from its checked fields, nested dataclasses built from their mappings."""
    if cls is dict:
        return values
    hints = typing.get_type_hints(cls)
    return cls(**{k: built_object(hints[k], v) if isinstance(v, dict) and isinstance(hints.get(k), type)
                  and dataclasses.is_dataclass(hints[k]) else v for k, v in values.items()})


def did_you_mean(key: str, given: dict, named: dict, prefix: str = "task.") -> str:
    """Where the user probably meant to put `key`: a nested setting of that name (task.lr for
    task.optimizer.lr), else a parameter spelt alike (task.max_step)."""
    import difflib

    def nested(value: Any, path: str) -> list[str]:
        if not isinstance(value, dict):
            return []
        here = [f"{path}.{key}"] if key in value else []
        return here + [p for k, v in value.items() if k != key for p in nested(v, f"{path}.{k}")]

    found = [p for k, v in given.items() if k != key for p in nested(v, f"{prefix}{k}")]
    found = found or [f"{prefix}{m}" for m in difflib.get_close_matches(key, list(named), n=1)]
    return f" (did you mean {found[0]}?)" if found else ""


def hints(fn: Callable, named: dict[str, inspect.Parameter]) -> dict[str, Any]:
    """The parameters' annotations, where they evaluate: what values are checked and converted to."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:   # an annotation that does not evaluate: no conversion, values pass as given
        return {}
    return {name: hints[name] for name in named if name in hints}


def coerce(key: str, value: Any, ann: Any) -> Any:
    """A config value converted to the parameter's annotation: int, float, bool and str as OmegaConf
    converts them; list, tuple, Sequence and dict of those element by element (a YAML list becomes a
    tuple for `tuple[...]`); Literal choices checked; an Enum member by its name or value; Optional
    of any of these. Any other annotation (a class, Any) takes the value as given, as does a
    `{_target_: ...}` value, built later."""
    import types
    from collections.abc import Mapping, Sequence

    if ann is None or value is None or has_target(value):
        return value
    if ann in SIMPLE:
        return _simple(key, value, ann)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):   # by name, as OmegaConf does, or by value
        for member in ann:
            if value in (member.name, member.value) or value is member:
                return member
        raise UserError(f"task.{key}={shown(value)} is not allowed: one of {', '.join(m.name for m in ann)}")
    origin, args = typing.get_origin(ann) or ann, typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return coerce(key, value, rest[0]) if len(rest) == 1 else value
    if origin is typing.Literal:
        if any(choice == value and type(choice) is type(value) for choice in args):
            return value
        raise UserError(f"task.{key}={shown(value)} is not allowed: one of {', '.join(map(str, args))}")
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"task.{key}={shown(value)} is not allowed: a list ([...])")
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        kinds = args if fixed else (args[:1] or (None,)) * len(value)
        if len(kinds) != len(value):
            raise UserError(f"task.{key}={shown(value)} is not allowed: a list of {len(kinds)} values")
        items = [coerce(f"{key}[{i}]", v, k) for i, (v, k) in enumerate(zip(value, kinds))]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise UserError(f"task.{key}={shown(value)} is not allowed: a mapping ({{...}})")
        kind = args[1] if len(args) == 2 else None
        return {k: coerce(f"{key}.{k}", v, kind) for k, v in value.items()}
    return value


def _simple(key: str, value: Any, hint: type) -> Any:
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    from dataclasses import make_dataclass

    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    node = OmegaConf.structured(make_dataclass("Param", [("value", typing.Optional[hint], None)]))
    try:
        node.value = value
    except ValidationError as e:
        kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[hint]
        raise UserError(f"task.{key}={shown(value)} is not allowed: {kind} ({first_line(e)})") from None
    return node.value


def plain(value: Any) -> bool:
    """A default that means the same in every process (no object whose text is its address)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    return False


def has_target(value: Any) -> bool:
    if isinstance(value, dict):
        return "_target_" in value or any(has_target(v) for v in value.values())
    if isinstance(value, list):
        return any(has_target(v) for v in value)
    return False
