"""A script task's keys, checked where Hydra composed the job, before any rank starts -> ScriptSpec.

Every path is made absolute here, against the directory the user launched from (Hydra's original
cwd): the script runs in the run dir, and a spawned rank or a SLURM job may start elsewhere. The
command line is rendered here too, so a bad value is one line now, not a crash in every rank.

    args                 mapping -> argv in args_style; a list -> as given, word by word
    args_style           space: --key value   equals: --key=value
                         configurator: --key=value with Python literals (nanoGPT's configurator.py)
                         hydra: key=value overrides, for a Hydra app (expgpu.script.hydra_app)
    resume_args          added on a rerun in the same run dir (a mapping merges into a mapping args)
    resume_if            ... only when this file exists in the run dir (the script's checkpoint)
    inputs               paths under the launch dir, linked into the run dir at the same place
    grace_s              seconds a stopped script has to exit before SIGKILL
    output_timeout_s     seconds without output on every rank's stdout and stderr that make a hang (null: off),
                         for a script that logs no rows (expgpu.script.watch)
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from expgpu.errors import UserError, first_line
from expgpu.script import hydra_app

KEYS = ("script", "module", "args", "args_style", "inputs", "resume_args", "resume_if", "grace_s", "output_timeout_s")
STYLES = {"space": "--key value", "equals": "--key=value",
          "configurator": "--key=value with values as Python literals, for nanoGPT's configurator.py",
          "hydra": "key=value Hydra overrides, for a Hydra app (@hydra.main)"}
# Well under SLURM's KillWait (30 s between its SIGTERM and SIGKILL): expgpu still writes the
# result and may requeue after the script is gone.
GRACE_S = 10.0
_SCALARS = (str, int, float, bool, type(None))


def is_script(task: Mapping) -> bool:
    return task.get("script") is not None or task.get("module") is not None


@dataclass(frozen=True)
class ScriptSpec:
    name: str
    command: list[str]        # python and the script's path, or python -m the module
    args: list[str]           # the arguments of a first start
    resume_args: list[str]    # ... of a rerun in the same run dir (args merged with resume_args)
    resume_if: str | None     # relative to the run dir
    inputs: list[list[str]]   # [name under the run dir, absolute path it links to]
    grace_s: float
    launch_dir: str
    module: bool
    output_timeout_s: float | None = None   # None: the script's output is not watched

    def argv(self, resume: bool) -> list[str]:
        return self.command + (self.resume_args if resume else self.args)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> ScriptSpec:
        return cls(**data)


def prepare(plain: dict, launch_dir: str | Path) -> None:
    """For a script task, check its keys and put its ScriptSpec in plain["script"], where every rank
    (spawned ones read the config from the run dir) finds it; nothing for a function task."""
    task = plain["task"]
    if not is_script(task):
        return
    if task.get("_target_") is not None:
        raise UserError(f"task._target_={task['_target_']} and task.{'script' if task.get('script') else 'module'}: "
                        "a task is a function (_target_) or a script (script or module), not both; drop one")
    if plain["launch"]["isolation"] == "set_device":
        raise UserError("launch.isolation=set_device is not allowed for a script task: expgpu cannot call "
                        "torch.cuda.set_device inside the script; allowed: auto (the node's planned GPUs, in "
                        "local-rank order) or visible_devices (each rank only its own)")
    if plain["checkpoint"]["verify"]:
        raise UserError("checkpoint.verify=true compares expgpu's own checkpoints; a script task keeps its own "
                        "(see task.resume_args): drop checkpoint.verify")
    _refuse_unread(plain)
    plain["script"] = build(task, Path(launch_dir).absolute()).to_dict()


# What only a task function's Run reads (its model's wrap, its checkpoints, its data loader, injected faults), and
# why a script has none of it: set for a script task, such a key would change nothing.
_RUN_ONLY = {"launch": ("wrap", "fsdp", "ddp"), "checkpoint": ("every_steps", "poll_every", "format", "async_save"),
             "data": None, "faults": None, "backend": ("name",)}
_WHY = {"launch": "the script wraps its own model", "checkpoint": "the script keeps its own checkpoints "
        "(task.resume_args)", "data": "the script loads its own data", "faults": "expgpu injects faults into "
        "run.steps, which a script does not call", "backend": "the script makes its own process group "
        "(init_process_group's backend)"}


def _refuse_unread(plain: dict) -> None:
    """One line for the first key under _RUN_ONLY set away from its default (sections the caller left out of
    `plain` are not checked)."""
    from omegaconf import OmegaConf

    from expgpu.schema import BackendConfig, CheckpointConfig, DataConfig, FaultsConfig, LaunchConfig

    schemas = {"launch": LaunchConfig, "checkpoint": CheckpointConfig, "data": DataConfig, "faults": FaultsConfig,
               "backend": BackendConfig}
    for section, keys in _RUN_ONLY.items():
        if section not in plain:
            continue
        default = OmegaConf.to_container(OmegaConf.structured(schemas[section]), enum_to_str=True)
        for key in keys or default:
            value = plain[section].get(key, default[key])
            if isinstance(value, dict):   # launch.ddp: the keys set inside it
                changed = [(f"{key}.{k}", v) for k, v in value.items() if v != default[key].get(k)]
            else:
                changed = [(key, value)] if value != default[key] else []
            if changed:
                name, value = changed[0]
                raise UserError(f"{section}.{name}={value} is not read by a script task: {_WHY[section]}; "
                                "drop the key")


def checked(cfg, launch_dir: str | Path) -> dict | None:
    """A composed job config's script task checked as the job's start will check it (its keys, its args
    written in its style), by a launcher before any job starts: a bad value is one line then, not a failure
    of every job. Its ScriptSpec as a dict, as prepare() makes it from this launch dir; None for a function task."""
    from omegaconf import OmegaConf

    plain = {k: OmegaConf.to_container(cfg[k], resolve=True, enum_to_str=True)
             for k in ("task", "launch", "checkpoint", "data", "faults", "backend") if k in cfg}
    prepare(plain, launch_dir)
    return plain.get("script")


def build(task: Mapping, launch_dir: Path) -> ScriptSpec:
    _check_keys(task)
    script, module = task.get("script"), task.get("module")
    if script is not None and module is not None:
        raise UserError(f"task.script={script} and task.module={module}: name one of them (a file to run, "
                        "or a module to run as python -m)")
    if script is not None:
        source = _script_file(script, launch_dir)
        command = [sys.executable, str(source)]
        name, is_module = Path(str(script)).stem, False
    else:
        source = _check_module(module, launch_dir)
        command, name, is_module = [sys.executable, "-m", module], module.rsplit(".", 1)[-1], True
    style = task.get("args_style") or "space"
    if style not in STYLES:
        raise UserError(f"task.args_style={style!r} is not allowed: one of "
                        + "; ".join(f"{k} ({v})" for k, v in STYLES.items()))
    _hydra_app_needs_its_style(style, source, "script" if script is not None else "module",
                               script if script is not None else module)
    inputs = _inputs(task.get("inputs"), launch_dir)
    render = _Renderer(style, launch_dir, [name for name, _ in inputs])
    args, resume = task.get("args"), task.get("resume_args")
    first = render.words(args, "task.args")
    render.words(resume, "task.resume_args")   # checked on its own, so the error names the right key
    if isinstance(args, dict) and isinstance(resume, dict):
        again = render.words(_merged(args, resume), "task.resume_args")
    else:
        again = first + render.words(resume, "task.resume_args")
    if style == "hydra":
        first, again = hydra_app.OWN + first, hydra_app.OWN + again
    return ScriptSpec(name=task.get("name") or name, command=command, args=first, resume_args=again,
                      resume_if=_resume_if(task.get("resume_if")), inputs=inputs,
                      grace_s=_grace(task.get("grace_s", GRACE_S)), launch_dir=str(launch_dir), module=is_module,
                      output_timeout_s=_output_timeout(task.get("output_timeout_s")))


def _hydra_app_needs_its_style(style: str, source: str | None, key: str, value: str) -> None:
    line = hydra_app.main_line(source)
    if line is not None and style != "hydra":
        raise UserError(f"task.{key}={value} is a Hydra app (@hydra.main at line {line} of {source}): set "
                        "task.args_style=hydra, which passes task.args as its key=value overrides and keeps its "
                        "Hydra's output in the run dir (.hydra/script), not over expgpu's own .hydra")


def _merged(args: dict, resume: dict) -> dict:
    """resume_args over args, nested mappings (dotted flags) merged key by key: resume's values win."""
    out = dict(args)
    for key, value in resume.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _check_keys(task: Mapping) -> None:
    """Only a script's keys and the run's name; the run's other keys (seed, precision, ...) are a
    function task's, so a value of one that is not its default would be silently ignored."""
    from expgpu.task import RUN_KEYS

    for key, value in task.items():
        if key in KEYS or key == "name":
            continue
        if key in RUN_KEYS:
            if value != RUN_KEYS[key] and str(value) != str(RUN_KEYS[key]):
                if key == "on_nonfinite":   # the script's loop is its own: expgpu cannot end it at a step
                    raise UserError(f"task.on_nonfinite={value!r} does not apply to a script task (it stops a task "
                                    "function's run.steps); a script's nan loss is said from its expgpu.log rows, and "
                                    "the script itself stops on it (math.isfinite(loss) in its loop)")
                raise UserError(f"task.{key}={value!r} does not apply to a script task (it is for task functions); "
                                f"give the script its own setting in task.args (e.g. task.args.{key}={value})")
            continue
        close = difflib.get_close_matches(key, KEYS, n=1)
        hint = f"task.{close[0]}" if close else f"task.args.{key}"
        raise UserError(f"task.{key}: a script task has no key {key!r} (did you mean {hint}?); its keys: script or "
                        "module, args, args_style, inputs, resume_args, resume_if, grace_s, output_timeout_s, name")


def _script_file(script: Any, launch_dir: Path) -> Path:
    if not isinstance(script, str) or not script.strip():
        raise UserError(f"task.script={script!r} is not allowed: the path of a Python file, relative to the "
                        f"directory you launched from ({launch_dir})")
    path = launch_dir / Path(script).expanduser()
    if not path.is_file():
        what = "is a directory; name the .py file in it" if path.is_dir() else "does not exist"
        raise UserError(f"task.script={script}: {path} {what} (a script path is relative to the directory "
                        f"you launched from, {launch_dir})")
    return path


def _check_module(module: Any, launch_dir: Path) -> str | None:
    """`python -m module` would find it: on sys.path or in the launch dir (which the child's
    PYTHONPATH begins with); its file. Parent packages are imported to look; the module itself is not run."""
    key = "task.module"
    if not isinstance(module, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module):
        raise UserError(f"{key}={module!r} is not allowed: a module name such as pkg.train "
                        "(run as python -m pkg.train)")
    sys.path.insert(0, str(launch_dir))
    try:
        found = importlib.util.find_spec(module)
        if found is not None and found.submodule_search_locations is not None:   # a package: its __main__
            found = importlib.util.find_spec(f"{module}.__main__")
            if found is None:
                raise UserError(f"{key}={module}: a package without __main__.py, which python -m needs; "
                                "name the module to run (e.g. pkg.train)")
    except ModuleNotFoundError:
        found = None
    except UserError:
        raise
    except Exception as e:   # a parent package that raises on import
        raise UserError(f"{key}={module}: importing its package failed: {type(e).__name__}: {first_line(e)}") from None
    finally:
        sys.path.remove(str(launch_dir))
    if found is None:
        raise UserError(f"{key}={module}: no module named {module!r} in the launch dir ({launch_dir}) or on "
                        "PYTHONPATH, so python -m would fail; check the name, or launch from its directory")
    return found.origin


def _inputs(inputs: Any, launch_dir: Path) -> list[list[str]]:
    if inputs is None:
        return []
    if not isinstance(inputs, list):
        raise UserError(f"task.inputs={inputs!r} is not allowed: a list of paths under the launch dir, "
                        "e.g. [data, configurator.py]")
    out = []
    for i, name in enumerate(inputs):
        where = f"task.inputs[{i}]={name!r}"
        if not isinstance(name, str) or not name.strip():
            raise UserError(f"{where} is not allowed: a path relative to the launch dir ({launch_dir})")
        rel = Path(os.path.normpath(name))
        if rel.is_absolute() or rel.parts[0] == "..":
            raise UserError(f"{where}: give it relative to the launch dir ({launch_dir}), inside it; it is "
                            "linked into the run dir at the same relative path")
        if not (launch_dir / rel).exists():
            raise UserError(f"{where}: {launch_dir / rel} does not exist (inputs are relative to the directory "
                            f"you launched from, {launch_dir})")
        out.append([str(rel), str(launch_dir / rel)])
    return out


def _resume_if(path: Any) -> str | None:
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise UserError(f"task.resume_if={path!r} is not allowed: null, or a file the script writes, relative to "
                        "the run dir (e.g. out/ckpt.pt): resume_args are added only when it exists")
    return path


def _grace(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"task.grace_s={value!r} is not allowed: seconds > 0 that a stopped script has to exit "
                        f"before SIGKILL (default {GRACE_S:g}; keep it under SLURM's KillWait, 30 s by default)")
    return float(value)


def _output_timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"task.output_timeout_s={value!r} is not allowed: null (the script's output is not watched), "
                        "or seconds > 0 without a line of output on any rank that make the run hung (for a script "
                        "that logs no rows with expgpu.log: those are watched by launch.hang.timeout_s)")
    return float(value)


class _Renderer:
    """task.args -> the script's argv words, in one args_style."""

    def __init__(self, style: str, launch_dir: Path, inputs: list[str]):
        self.style, self.launch_dir, self.inputs = style, launch_dir, [Path(i) for i in inputs]

    def words(self, args: Any, where: str) -> list[str]:
        if args is None:
            return []
        if isinstance(args, list):
            out = []
            for i, word in enumerate(args):
                if not isinstance(word, _SCALARS) or word is None:
                    raise UserError(f"{where}[{i}]={word!r} is not allowed: a list of args is the script's "
                                    "command-line words (strings or numbers); a mapping ({lr: 0.01}) renders them")
                out.append(self.path(word) if isinstance(word, str) else str(word))
            return out
        if not isinstance(args, dict):
            raise UserError(f"{where}={args!r} is not allowed: a mapping of the script's arguments ({{lr: 0.01}}), "
                            "or a list of its command-line words")
        return [w for key, value in args.items() for w in self.pair(str(key), value, f"{where}.{key}")]

    def pair(self, key: str, value: Any, where: str) -> list[str]:
        if isinstance(value, dict):
            # dotted flags, as LightningCLI (--trainer.max_epochs) and minGPT's chargpt.py
            # (--trainer.learning_rate=5e-4) take them: {trainer: {learning_rate: 5e-4}}
            return [w for k, v in value.items() for w in self.pair(f"{key}.{k}", v, f"{where}.{k}")]
        flag = key if key.startswith("-") else f"--{key}"
        many = isinstance(value, list)
        if not (isinstance(value, _SCALARS) or (many and all(isinstance(v, _SCALARS) for v in value))):
            raise UserError(f"{where}={value!r} is not allowed: a number, string, true/false, null, a list "
                            "of those, or a mapping of them (dotted flags: --trainer.lr=...)")
        if self.style == "hydra":
            return [hydra_app.override(key, [self.path(v) for v in value] if many else self.path(value), where)]
        if self.style == "configurator":
            text = _literal([self.path(v) for v in value] if many else self.path(value))
            if "=" in key or "=" in text:
                raise UserError(f"{where}={value!r}: args_style=configurator cannot pass '=' in a key or value "
                                "(nanoGPT's configurator.py splits --key=value at every '=')")
            return [f"{flag}={text}"]
        if value is True:
            return [flag]          # an argparse store_true flag
        if value is False or value is None:
            return []              # store_true left off; null: the script's default
        if many and self.style == "equals":
            raise UserError(f"{where}={value!r}: args_style=equals passes one value per key; use args_style=space "
                            "(--key a b), or a string")
        values = [self._text(v) for v in (value if many else [value])]
        return [flag, *values] if self.style == "space" else [f"{flag}={values[0]}"]

    def _text(self, value: Any) -> str:
        return self.path(value) if isinstance(value, str) else str(value)

    def path(self, value: Any) -> Any:
        """A relative path that exists under the launch dir, absolute: the script runs in the run dir.
        Not one under task.inputs, which the run dir links at the same relative path."""
        if not isinstance(value, str) or not value or os.path.isabs(value):
            return value
        rel = Path(os.path.normpath(value))
        if any(rel.parts[:len(i.parts)] == i.parts for i in self.inputs):
            return value
        try:
            exists = (self.launch_dir / rel).exists()
        except OSError:   # a name too long to be a path
            return value
        return str(self.launch_dir / rel) if exists else value


def _literal(value: Any) -> str:
    """How nanoGPT's configurator reads it back: literal_eval, else the raw string. A string that
    would read as another type ('1e-3', 'True') is quoted, so it stays a string."""
    if not isinstance(value, str):
        return repr(value)
    try:
        ast.literal_eval(value)
    except Exception:
        return value
    return repr(value)
