"""What a task is: a training function `fn(run, **params)`, named by the task file's `_target_`.

    # conf/task/gan.yaml                 python -m expgpu task=gan task.lr_d=1e-3
    _target_: my_tasks.gan.train
    _partial_: true
    lr_d: 2e-3
    max_steps: 400

A task file without `_target_` (model + dataset + optimizer + loss + ...) gives the parameters of
the built-in supervised function, `expgpu.tasks.supervised.train`: one loop, not two.

A few keys belong to the run and are read by expgpu whatever the function (RUN_KEYS: the seed,
the logging cadence and what a row keeps, the precision of run.autocast); they reach the
function too when it names them. Every other key must be a parameter of the function: a
misspelt one is an error naming it, not a setting silently ignored. Values are checked against
the function's annotations (int, float, bool, str, Literal, Enum, and lists, tuples and dicts of
them), so `lr: 2e-3`, `task.max_steps=abc` or `task.layers=[a,b]` for `layers: list[int]` fail
or convert before any rank starts training. Nested `{_target_: ...}` values are built
(hydra.utils.instantiate) just before the call, after the run is seeded and this process owns
its GPU.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import inspect
import json
import typing
from dataclasses import dataclass
from typing import Any, Callable

from expgpu.errors import UserError, first_line, shown

SUPERVISED = "expgpu.tasks.supervised.train"
# What every rank of a function task imports before the task's own code, so that a process forked
# after importing them (expgpu.launch.warm, the warm server, a gpu_pool job) starts warm: torch, the
# torch._dynamo the first torch.optim optimizer pulls in (2 s on 2 cores), what torch.save and the run dir's
# process record (psutil) import at first use, and expgpu's line.
RANK_IMPORTS = ["torch", "torch.optim", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
                "torch.utils.serialization", "hydra.utils", "psutil", "expgpu.launch.worker",
                "expgpu.launch.warm_client", "expgpu.train.run", "expgpu.train.agreement", "expgpu.loggers.csv",
                "expgpu.distributed.group", "expgpu.task", "expgpu.tasks.supervised"]
# ... and every rank of a script task: it only supervises the script's own process, which imports torch.
SCRIPT_RANK_IMPORTS = ["expgpu.launch.worker", "expgpu.script.runner"]
# ... and rank 0 of a job an optimizing sweeper started as a trial (its environment names the trial's
# file, expgpu.envvars.TRIAL): it reports to the study at its first evaluation (Optuna and the study's
# storage, ~40 ms of a pruned trial's few hundred).
TRIAL_IMPORTS = ["optuna", "expgpu.tune.bridge", "expgpu.tune.settings", "expgpu.tune.storage"]
# The run's own keys and their defaults. seed_per_rank None: true for a task function (each rank
# draws its own dropout masks and noise), false for the built-in loop (as before it existed).
RUN_KEYS: dict[str, Any] = {"name": None, "seed": 0, "seed_per_rank": None, "log_every": 10, "log_reduce": "last",
                            "precision": 32}
PRECISIONS = ("32", "16", "bf16")
# What a metrics.jsonl row holds for a name logged several times since the last row (expgpu.loggers.jsonl).
LOG_REDUCES = ("last", "mean")
# Settings a resume may change: the rest must match the checkpoint's (its fingerprint).
MAY_CHANGE = ("max_steps", "log_every", "log_reduce", "name", "eval_every", "eval_dataset", "eval_batch_size",
              "compile")
_SIMPLE = (int, float, bool, str)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    target: str            # the function's dotted path
    fn: Callable
    params: dict           # its keyword parameters, as config (nested _target_ not yet built)
    seed: int
    seed_per_rank: bool
    log_every: int
    log_reduce: str        # "last" | "mean"
    precision: str         # "32" | "16" | "bf16"
    identity: dict         # the settings a checkpoint must share with its resume
    fingerprint: str
    # (parameter name, its dataclass or dict) when the function takes the whole task config as one
    # object, `def train(run, cfg: GPTConfig)`: params then holds its fields, built into it at the call
    config_object: tuple[str, Any] | None = None


def locate(path: str, key: str) -> Any:
    """Import `pkg.module.attr`; a failure names the key and says why it did not import."""
    if not isinstance(path, str) or not path.strip():
        raise UserError(f"{key}={path!r}: needs a dotted path to import, e.g. my_tasks.train.train")
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):
                continue   # that prefix is no module: try a shorter one
            raise UserError(f"{key}={path}: importing {module} failed: {type(e).__name__}: {e}") from None
        except Exception as e:   # the module exists but raised (a syntax error, a missing dependency)
            raise UserError(f"{key}={path}: importing {module} failed: {type(e).__name__}: "
                            f"{first_line(e)}") from None
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                raise UserError(f"{key}={path}: {'.'.join(parts[:j])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise UserError(f"{key}={path}: no module named {parts[0]!r} (is it installed, or on PYTHONPATH?)")


def resolve(task_cfg: dict) -> TaskSpec:
    """The task config -> the function to call and its checked parameters (a UserError otherwise)."""
    cfg = dict(task_cfg)
    target = cfg.pop("_target_", None) or SUPERVISED
    if cfg.pop("_partial_", True) is not True:
        raise UserError("task._partial_=false: expgpu calls the task function itself, as fn(run, **params); "
                        "use _partial_: true")
    fn = locate(target, "task._target_")
    if not callable(fn):
        raise UserError(f"task._target_={target}: a {type(fn).__name__}, not a function to call as fn(run, ...)")
    run_keys = {k: cfg.pop(k, default) for k, default in RUN_KEYS.items()}
    named, var_kw = _parameters(fn, target)
    hints = _hints(fn, named)
    whole = _config_object(named, hints, cfg)
    if whole is not None:
        # the run's keys reach a dataclass that has such a field (a script's own `seed`), a dict never
        names = [f.name for f in dataclasses.fields(whole[1])] if whole[1] is not dict else []
        params = _check_fields(whole[1], {**cfg, **{k: task_cfg[k] for k in RUN_KEYS if k in names and k in task_cfg}},
                               f"{target} takes its parameters as {whole[0]}: {_type_name(whole[1])}")
        defaults = _field_defaults(whole[1])
    else:
        params = _check_params(cfg, named, var_kw, target, hints)
        for k in RUN_KEYS:
            if k in named and k in task_cfg:
                params[k] = task_cfg[k]
        defaults = {n: p.default for n, p in named.items() if p.default is not p.empty and _plain(p.default)}
    settings = _run_settings(run_keys, classic=target == SUPERVISED)
    identity = {"_target_": target, **{k: v for k, v in {**defaults, **params}.items() if k not in MAY_CHANGE},
                "seed": settings["seed"], "seed_per_rank": settings["seed_per_rank"],
                "precision": settings["precision"]}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return TaskSpec(name=run_keys["name"] or target.rsplit(".", 2)[-2], target=target, fn=fn, params=params,
                    identity=identity, fingerprint=digest, config_object=whole, **settings)


def _config_object(named: dict[str, inspect.Parameter], hints: dict[str, Any], given: dict) -> tuple[str, Any] | None:
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


def _type_name(cls: Any) -> str:
    return getattr(cls, "__name__", str(cls))


def _check_fields(cls: Any, given: dict, whose: str, prefix: str = "task.") -> dict:
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
            raise UserError(f"{prefix}{key}: {whose} has no field {key!r}{_did_you_mean(key, given, fields, prefix)}; "
                            f"its fields: {', '.join(fields)}")
        ann = hints.get(key)
        if isinstance(ann, type) and dataclasses.is_dataclass(ann) and isinstance(value, dict):
            out[key] = _check_fields(ann, value, f"{_type_name(cls)}.{key}: {_type_name(ann)}", f"{prefix}{key}.")
        else:
            out[key] = _coerce(f"{prefix[len('task.'):]}{key}", value, ann)
    for name, f in fields.items():
        if name not in given and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"{prefix}{name}: {whose} needs it (a field without a default); "
                            f"set it in the task file or as {prefix}{name}=...")
    return out


def _field_defaults(cls: Any) -> dict:
    """The config object's plain defaults, which belong to the run's identity as a function's do."""
    if cls is dict:
        return {}
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING and _plain(f.default)}


def _built_object(cls: Any, values: dict) -> Any:
    """The config object from its checked fields, nested dataclasses built from their mappings."""
    if cls is dict:
        return values
    hints = typing.get_type_hints(cls)
    return cls(**{k: _built_object(hints[k], v) if isinstance(v, dict) and isinstance(hints.get(k), type)
                  and dataclasses.is_dataclass(hints[k]) else v for k, v in values.items()})


def _parameters(fn: Callable, target: str) -> tuple[dict[str, inspect.Parameter], bool]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise UserError(f"task._target_={target}: its parameters cannot be read; "
                        "name a Python function def train(run, ...)") from None
    ps = list(sig.parameters.values())
    if not ps or ps[0].kind not in (ps[0].POSITIONAL_ONLY, ps[0].POSITIONAL_OR_KEYWORD, ps[0].VAR_POSITIONAL):
        raise UserError(f"task._target_={target}: takes no positional parameter for the run; "
                        f"expgpu calls it as fn(run, **params): def {getattr(fn, '__name__', 'train')}(run, ...)")
    named = {p.name: p for p in ps[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind == p.VAR_KEYWORD for p in ps)


def _check_params(given: dict, named: dict[str, inspect.Parameter], var_kw: bool, target: str,
                  hints: dict[str, Any]) -> dict:
    for key in given:
        if key not in named and not var_kw:
            takes = ", ".join(named) or "nothing"
            raise UserError(f"task.{key}: {target} takes no parameter {key!r}{_did_you_mean(key, given, named)}; "
                            f"it takes {takes} (and the run's keys {', '.join(RUN_KEYS)})")
    for name, p in named.items():
        if p.default is p.empty and name not in given and name not in RUN_KEYS:
            raise UserError(f"task.{name}: {target} needs it (a parameter without a default); "
                            f"set it in the task file or as task.{name}=...")
    return {k: _coerce(k, v, hints.get(k)) for k, v in given.items()}


def _did_you_mean(key: str, given: dict, named: dict, prefix: str = "task.") -> str:
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


def _check_target_keys(obj: Any, value: dict, where: str) -> None:
    """A `{_target_: ...}` entry's keys against what its callable takes: a misspelt key is named with what is
    allowed, not left to a TypeError from inside the build (a callable whose parameters cannot be read, or that
    takes **kwargs, is left to its own checks)."""
    try:
        ps = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in ps):
        return
    named = {p.name: p for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for k in value:
        if not k.startswith("_") and k not in named:
            raise UserError(f"{where}.{k}: {value['_target_']} takes no parameter {k!r}"
                            f"{_did_you_mean(k, {}, named, prefix=where + '.')}; it takes {', '.join(named)}")


def _hints(fn: Callable, named: dict[str, inspect.Parameter]) -> dict[str, Any]:
    """The parameters' annotations, where they evaluate: what values are checked and converted to."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:   # an annotation that does not evaluate: no conversion, values pass as given
        return {}
    return {name: hints[name] for name in named if name in hints}


def _coerce(key: str, value: Any, ann: Any) -> Any:
    """A config value converted to the parameter's annotation: int, float, bool and str as OmegaConf
    converts them; list, tuple, Sequence and dict of those element by element (a YAML list becomes a
    tuple for `tuple[...]`); Literal choices checked; an Enum member by its name or value; Optional
    of any of these. Any other annotation (a class, Any) takes the value as given, as does a
    `{_target_: ...}` value, built later."""
    import types
    from collections.abc import Mapping, Sequence

    if ann is None or value is None or _has_target(value):
        return value
    if ann in _SIMPLE:
        return _simple(key, value, ann)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):   # by name, as OmegaConf does, or by value
        for member in ann:
            if value in (member.name, member.value) or value is member:
                return member
        raise UserError(f"task.{key}={shown(value)} is not allowed: one of {', '.join(m.name for m in ann)}")
    origin, args = typing.get_origin(ann) or ann, typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _coerce(key, value, rest[0]) if len(rest) == 1 else value
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
        items = [_coerce(f"{key}[{i}]", v, k) for i, (v, k) in enumerate(zip(value, kinds))]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise UserError(f"task.{key}={shown(value)} is not allowed: a mapping ({{...}})")
        kind = args[1] if len(args) == 2 else None
        return {k: _coerce(f"{key}.{k}", v, kind) for k, v in value.items()}
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


def _run_settings(keys: dict, classic: bool) -> dict:
    seed, every, per_rank, precision = keys["seed"], keys["log_every"], keys["seed_per_rank"], keys["precision"]
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"task.seed={seed!r} is not allowed: an integer")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UserError(f"task.log_every={every!r} is not allowed: an integer >= 1")
    if per_rank is not None and not isinstance(per_rank, bool):
        raise UserError(f"task.seed_per_rank={per_rank!r} is not allowed: true, false or null "
                        "(null: true for a task function, false for the built-in loop)")
    if keys["log_reduce"] not in LOG_REDUCES:
        raise UserError(f"task.log_reduce={keys['log_reduce']!r} is not allowed: last or mean (a name logged "
                        "several times between two metrics.jsonl rows: its last value, or their mean)")
    if str(precision) not in PRECISIONS:
        raise UserError(f"task.precision={precision!r} is not allowed: 32, 16 or bf16")
    if keys["name"] is not None and not isinstance(keys["name"], str):
        raise UserError(f"task.name={keys['name']!r} is not allowed: a string")
    return {"seed": seed, "log_every": every, "log_reduce": keys["log_reduce"], "precision": str(precision),
            "seed_per_rank": (not classic) if per_rank is None else per_rank}


def _plain(value: Any) -> bool:
    """A default that means the same in every process (no object whose text is its address)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _has_target(value: Any) -> bool:
    if isinstance(value, dict):
        return "_target_" in value or any(_has_target(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_target(v) for v in value)
    return False


def build_params(spec: TaskSpec) -> dict[str, Any]:
    """The function's keyword arguments, with every `{_target_: ...}` inside them built, in order."""
    from hydra.utils import instantiate

    built = {}
    for key, value in spec.params.items():
        if not _has_target(value):
            built[key] = value
            continue
        if isinstance(value, dict) and "_target_" in value:   # a clear reason if it does not import or fit
            _check_target_keys(locate(value["_target_"], f"task.{key}._target_"), value, f"task.{key}")
        try:
            built[key] = instantiate(value, _convert_="all")
        except Exception as e:
            cause = e.__cause__ or e
            what = value.get("_target_") if isinstance(value, dict) else "its _target_ entries"
            raise UserError(f"task.{key}: cannot build {what}: {type(cause).__name__}: {first_line(cause)}") from None
    if spec.config_object is None:
        return built
    name, cls = spec.config_object
    try:
        return {name: _built_object(cls, built)}
    except Exception as e:   # the dataclass's own checks (__post_init__)
        raise UserError(f"task: {_type_name(cls)} refused the task's settings: {type(e).__name__}: "
                        f"{first_line(e)}") from None
