"""What a task is: a training function `fn(run, **params)`, named by the task file's `_target_`.

    # conf/task/gan.yaml                 python -m expgpu task=gan task.lr_d=1e-3
    _target_: my_tasks.gan.train
    _partial_: true
    lr_d: 2e-3
    max_steps: 400

A task file without `_target_` (model + dataset + optimizer + loss + ...) gives the parameters of
the built-in supervised function, `expgpu.tasks.supervised.train`: one loop, not two.

A few keys belong to the run and are read by expgpu whatever the function (RUN_KEYS: the seed,
the logging cadence and what a row keeps, the precision of run.autocast, what a nan loss does); they reach the
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
import hashlib
import importlib
import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable

from expgpu.errors import UserError, first_line
from expgpu.task import values

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
                            "precision": 32, "on_nonfinite": "continue"}
PRECISIONS = ("32", "16", "bf16")
# What a metrics.jsonl row holds for a name logged several times since the last row (expgpu.loggers.jsonl).
LOG_REDUCES = ("last", "mean")
# A logged loss or score that becomes nan or inf (expgpu.loggers.nonfinite): the run trains on, as a plain loop
# would, or every rank stops there (the run ends as `diverged`, final, nothing saved).
ON_NONFINITE = ("continue", "stop")
# Settings a resume may change: the rest must match the checkpoint's (its fingerprint).
MAY_CHANGE = ("max_steps", "log_every", "log_reduce", "name", "eval_every", "eval_dataset", "eval_batch_size",
              "compile", "on_nonfinite")


class ImportRaised(UserError):
    """The task's module exists but raised on import (not a syntax error): a module it imports is missing, a
    library would not load (flash-attn without the GPU driver's libcuda), its own code failed. Where its job
    runs may differ (the node's GPU and driver, the job's setup lines: `module load`, a venv), so a check
    before the job (expgpu.task.precheck) cannot settle it."""


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
    on_nonfinite: str      # "continue" | "stop"
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
            raise ImportRaised(f"{key}={path}: importing {module} failed: {type(e).__name__}: {e}") from None
        except Exception as e:   # the module exists but raised (a syntax error, a dependency that would not load)
            error = UserError if isinstance(e, SyntaxError) else ImportRaised
            raise error(f"{key}={path}: importing {module} failed: {type(e).__name__}: {first_line(e)}") from None
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
    hints = values.hints(fn, named)
    whole = values.config_object(named, hints, cfg)
    if whole is not None:
        # the run's keys reach a dataclass that has such a field (a script's own `seed`), a dict never
        names = [f.name for f in dataclasses.fields(whole[1])] if whole[1] is not dict else []
        given = {**cfg, **{k: task_cfg[k] for k in RUN_KEYS if k in names and k in task_cfg}}
        params = values.check_fields(whole[1], given,
                                     f"{target} takes its parameters as {whole[0]}: {values.type_name(whole[1])}")
        defaults = values.field_defaults(whole[1])
    else:
        params = _check_params(cfg, named, var_kw, target, hints)
        for k in RUN_KEYS:
            if k in named and k in task_cfg:
                params[k] = task_cfg[k]
        defaults = {n: p.default for n, p in named.items() if p.default is not p.empty and values.plain(p.default)}
    settings = _run_settings(run_keys, classic=target == SUPERVISED)
    identity = {"_target_": target, **{k: v for k, v in {**defaults, **params}.items() if k not in MAY_CHANGE},
                "seed": settings["seed"], "seed_per_rank": settings["seed_per_rank"],
                "precision": settings["precision"]}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return TaskSpec(name=run_keys["name"] or target.rsplit(".", 2)[-2], target=target, fn=fn, params=params,
                    identity=identity, fingerprint=digest, config_object=whole, **settings)


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
            raise UserError(f"task.{key}: {target} takes no parameter {key!r}{values.did_you_mean(key, given, named)}; "
                            f"it takes {takes} (and the run's keys {', '.join(RUN_KEYS)})")
    for name, p in named.items():
        if p.default is p.empty and name not in given and name not in RUN_KEYS:
            raise UserError(f"task.{name}: {target} needs it (a parameter without a default); "
                            f"set it in the task file or as task.{name}=...")
    return {k: values.coerce(k, v, hints.get(k)) for k, v in given.items()}


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
                            f"{values.did_you_mean(k, {}, named, prefix=where + '.')}; it takes {', '.join(named)}")


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
    if keys["on_nonfinite"] not in ON_NONFINITE:
        raise UserError(f"task.on_nonfinite={keys['on_nonfinite']!r} is not allowed: continue or stop (a logged loss "
                        "or score that becomes nan or inf: train on to the end, or stop every rank there)")
    return {"seed": seed, "log_every": every, "log_reduce": keys["log_reduce"], "precision": str(precision),
            "seed_per_rank": (not classic) if per_rank is None else per_rank, "on_nonfinite": keys["on_nonfinite"]}


def check_targets(spec: TaskSpec) -> None:
    """Each `{_target_: ...}` parameter's callable imported and its keys checked, before anything is built: one
    that does not import, or a key it does not take, is one line naming it, not a TypeError from the build."""
    for key, value in spec.params.items():
        if isinstance(value, dict) and "_target_" in value:
            _check_target_keys(locate(value["_target_"], f"task.{key}._target_"), value, f"task.{key}")


def build_params(spec: TaskSpec) -> dict[str, Any]:
    """The function's keyword arguments, with every `{_target_: ...}` inside them built, in order."""
    from hydra.utils import instantiate

    check_targets(spec)
    built = {}
    for key, value in spec.params.items():
        if not values.has_target(value):
            built[key] = value
            continue
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
        return {name: values.built_object(cls, built)}
    except Exception as e:   # the dataclass's own checks (__post_init__)
        raise UserError(f"task: {values.type_name(cls)} refused the task's settings: {type(e).__name__}: "
                        f"{first_line(e)}") from None
