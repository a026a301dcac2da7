"""`python -m expgpu [overrides]`: Hydra composes the config, expgpu.app runs it.

`expgpu status [DIR]` (a first word `status`, which no override is) shows where the runs are instead
(expgpu.status); `expgpu report DIR` writes a sweep's report again (expgpu.report, also `expgpu-report`);
`expgpu sbatch-script` prints scripts/expgpu.sbatch, which an install without the checkout has in the package;
`expgpu --version` names expgpu's version and its dependencies' (Hydra's own flag would name Hydra's only).

User errors (a wrong key, value, group option, environment variable, GPU id) end in
one line naming what is wrong and what is allowed, and exit code 2; no traceback.
"""

from __future__ import annotations

import time

_T0 = time.time()  # startup_s counts from here, in this process and in spawned workers

import faulthandler  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from expgpu import envvars  # noqa: E402
from expgpu.errors import EXIT_USER_ERROR, UserError  # noqa: E402


def conf_dir() -> str:
    """conf/ ships inside the wheel as expgpu/conf; a checkout has it at the top."""
    return str(_shipped("conf"))


def _versions() -> str:
    """expgpu's version and those of what a bug report needs beside it, from the installed metadata (no import)."""
    from importlib import metadata

    from expgpu import __version__

    def of(dist: str) -> str:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            return f"{dist} not installed"

    deps = ", ".join(of(d) for d in ("torch", "hydra-core", "omegaconf", "submitit", "optuna"))
    return f"expgpu {__version__} ({deps}; Python {sys.version.split()[0]})"


def _shipped(name: str) -> Path:
    """A file or dir at the top of the checkout, which the wheel ships inside the package (pyproject.toml)."""
    packaged = Path(__file__).parent / name
    return packaged if packaged.exists() else Path(__file__).resolve().parents[2] / name


def _one_line(e: BaseException) -> str | None:
    """The message of a config error as one line, or None if it is not one."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, MissingConfigException):
        text = str(e).split("\nConfig search path:")[0]
        text = " ".join(text.replace("\n\t", ", ").replace("\n", " ").split()).replace(":,", ":")
        if "Could not find 'hydra/sweeper/optuna'" in text:
            text += (" (Hydra's optuna sweeper is not installed: pip install 'expgpu[optuna]'; or expgpu's own, "
                     "with the same keys: hydra/sweeper=expgpu_optuna, pip install 'expgpu[tune]')")
        return text
    on_null = _override_on_null(e) or _sweep_inside_a_value(e) or _sweeper_params_in_a_dict(e)
    if on_null is not None:
        return on_null
    cause = e
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException):
        from expgpu.schema import schema_keys

        key = getattr(cause, "full_key", None) or ""
        msg = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        if type(cause).__name__ in ("ConfigKeyError", "ConfigAttributeError") and key:
            if key == "experiment":
                return _no_experiment_group(e)
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            allowed = schema_keys(parent)
            node = getattr(cause, "parent_node", None)
            if allowed is None and node is not None and hasattr(node, "keys"):
                allowed = [str(k) for k in node.keys()]   # a node without a schema: what it holds
            if allowed is not None:
                # Hydra's advice (+key=value) only where a new key is read: at the root (a note kept in the
                # run's config.yaml); inside a section of expgpu's or a plugin's, nothing would read it
                return (f"{key}: unknown key; allowed under {parent or 'the root'}: {', '.join(allowed)}"
                        f"{'' if parent else _append_hint(e)}")
        return f"{key}: {msg}" if key else msg
    if isinstance(e, (HydraException, OverrideParseException)):
        text = " ".join(str(e).split())
        if text.startswith("In 'local/") and "full_key: hydra.launcher." in text:
            text += ("; SLURM site settings belong in hydra/launcher/slurm_site/default.yaml, "
                     "which only SLURM sweeps read")
        return text
    return None


def _override_on_null(e: BaseException) -> str | None:
    """`logger.mlflow.experiment=x` while logger.mlflow is null (that logger not chosen): Hydra ends in a bare
    AssertionError ("Unexpected type for root: NoneType") that names nothing. The override and the null node,
    read from the frame of Hydra's that applied it; None for any other error (and for a Hydra whose frame
    differs: the traceback then, as before)."""
    from omegaconf import OmegaConf

    if not isinstance(e, AssertionError):
        return None
    override, cfg = _applying(e)
    if override is None or cfg is None:
        return None
    parts = override.key_or_group.split(".")
    nulls = [".".join(parts[:i]) for i in range(1, len(parts)) if OmegaConf.select(cfg, ".".join(parts[:i])) is None]
    if not nulls:
        return None
    text = f"{override.input_line}: {nulls[0]} is null in this config, so nothing under it can be set"
    if parts[0] == "logger" and len(nulls[0].split(".")) == 2:
        return text + f"; choose that logger too, e.g. logger=[csv,{parts[1]}], or drop the key"
    return text + f"; set {nulls[0]} itself"


def _applying(e: BaseException) -> tuple:
    """(the override, the config) of the frame of Hydra's that was applying an override when `e` was raised;
    (None, None) elsewhere (or for a Hydra whose frame differs)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "_apply_overrides_to_config":
        tb = tb.tb_next
    return (None, None) if tb is None else (tb.tb_frame.f_locals.get("override"), tb.tb_frame.f_locals.get("cfg"))


def _value(override) -> object:
    """The override's value as Hydra's parser reads it; None without an override, or where it cannot say."""
    try:
        return override.value() if override is not None else None
    except Exception:
        return None


def _sweep_inside_a_value(e: BaseException) -> str | None:
    """`hydra.sweeper.params={lr:tag(log,interval(1e-4,1e-1))}`: Hydra's grammar makes a sweep inside a dict or
    list a sweep object, which OmegaConf cannot hold: "tags: Unexpected type annotation: Set[str]" named nothing."""
    from hydra.core.override_parser.types import Sweep

    override, _ = _applying(e)
    value = _value(override)

    def holds(v) -> bool:
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return isinstance(v, Sweep) or any(holds(x) for x in items)

    if not isinstance(value, (dict, list)) or not holds(value):
        return None
    return (f"{override.input_line}: a sweep (choice, range, interval, tag) inside a {{dict}} or [list] is not "
            "a value Hydra can set; give each searched key an override of its own, e.g. python -m expgpu -m "
            "'task.optimizer.lr=tag(log, interval(1e-4, 1e-1))'")


def _sweeper_params_in_a_dict(e: BaseException) -> str | None:
    """`hydra.sweeper.params={...}` on the command line, where Hydra cannot set it: under its basic sweeper params
    is null, and OmegaConf fails merging a dict into it ("'NoneType' object has no attribute 'get'", a traceback);
    elsewhere a dotted key in it (`{task.optimizer.lr:'tag(...)'}`) is read as nested keys, and the line named
    hydra.sweeper.params.task.optimizer, which the user never wrote."""
    from omegaconf import OmegaConf

    override, cfg = _applying(e)
    if override is None or cfg is None or override.key_or_group != "hydra.sweeper.params":
        return None
    value = _value(override)
    if not isinstance(value, dict):
        return None
    key = next((str(k) for k in value if "." in str(k)), None) or next(iter(value), "lr")
    way = (f"give each searched key an override of its own, e.g. python -m expgpu -m '{key}=...', or "
           "hydra.sweeper.params in a config file")
    if OmegaConf.select(cfg, "hydra.sweeper.params") is None:
        return f"{override.input_line}: hydra.sweeper.params is null under this sweeper, and a {{dict}} cannot be " \
               f"merged into it from the command line; {way}"
    if "." in key:
        return (f"{override.input_line}: the dotted key {key!r} inside a {{dict}} is read as nested keys "
                f"(hydra.sweeper.params.{key}), not as one; {way}")
    return None


# Flags with which Hydra only prints (and runs no job)
_PRINT_ONLY = {"-c", "--cfg", "-i", "--info", "-h", "--help", "--hydra-help", "--version", "-sc",
               "--shell-completion"}

# A command line with these may bring configs of the user's, which may set hydra.mode (_skip_mode_composition)
_USER_CONFIG = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def _skip_mode_composition(args: list[str]) -> None:
    """Hydra composes a run's whole config twice: once (Hydra.get_mode) only to read hydra.mode, then for the
    run. Only an override or a config of the user's can set hydra.mode (expgpu's own never do:
    tests/config/test_hydra_mode.py); where the command line brings neither, get_mode answers None, as that
    composition would, without it: 0.11-0.19 s of every launch on a 2-core machine (each srun rank's too).
    Hydra then takes the mode from -m, as it did."""
    for a in args:
        key = a.split("=", 1)[0].lstrip("+~")
        if a.startswith(_USER_CONFIG) or key in ("hydra.mode", "hydra.searchpath", "experiment"):
            return
    from hydra._internal.hydra import Hydra

    if hasattr(Hydra, "get_mode"):   # Hydra 1.2-1.3 (pinned <1.4)
        Hydra.get_mode = lambda self, config_name, overrides: None


# Hydra's bash completion knows `app ...` and `python script.py ...`, not `python -m expgpu ...`: this
# one completes that, asking `python -m expgpu -sc query=bash` as Hydra's does, with the line as if
# the `expgpu` script had been typed.
_BASH_PYTHON_M = r"""export _HYDRA_OLD_COMP=$(complete -p python 2> /dev/null)
_expgpu_python_m_completion()
{
    local words=($COMP_LINE)
    if [ "${words[1]}" != "-m" ] || [ "${words[2]}" != "expgpu" ]; then
        return
    fi
    local line="expgpu ${COMP_LINE#*-m expgpu}"
    local choices=$(COMP_POINT=$COMP_POINT COMP_LINE="$line" ${words[0]} -m expgpu -sc query=bash)
    COMPREPLY=($(compgen -o nospace -o default -W "$choices" -- "${words[$COMP_CWORD]}"))
}
COMP_WORDBREAKS=${COMP_WORDBREAKS//=}
COMP_WORDBREAKS=$COMP_WORDBREAKS complete -o nospace -o default -F _expgpu_python_m_completion python python3
"""


def _completion_for_python_m(args: list[str]) -> bool:
    """`python -m expgpu -sc install=bash`: print the script above (True), else leave it to Hydra."""
    if not sys.argv[0].endswith("__main__.py"):
        return False   # the `expgpu` script: Hydra's own completion knows it
    for flag in ("-sc", "--shell-completion"):
        if flag in args and args.index(flag) + 1 < len(args):
            what = args[args.index(flag) + 1]
            if what == "install=bash":
                print(_BASH_PYTHON_M)
                return True
            if what == "uninstall=bash":
                print("unset -f _expgpu_python_m_completion")
                print(os.environ.get("_HYDRA_OLD_COMP", "complete -r python python3"))
                print("unset _HYDRA_OLD_COMP")
                return True
    return False


def _no_experiment_group(e: BaseException) -> str:
    """`experiment=X` where no config dir has an experiment/ group (expgpu ships none): Hydra takes it for a
    key of the config, and its advice (+experiment=X) would only add an unknown key."""
    hint = _append_hint(e)
    given = hint.split("+", 1)[1].rstrip(")") if "+" in hint else "experiment=NAME"
    name = given.split("=", 1)[1]
    return (f"{given}: no experiment/ group on the config search path; an experiment is a file "
            f"experiment/{name}.yaml (first line `# @package _global_`) in a dir of your own, given with "
            f"--config-dir (python -m expgpu --config-dir my_conf {given})")


def _append_hint(e: BaseException) -> str:
    """Hydra's own advice for a key the config does not have ("To append to your config use +k=v")."""
    for line in str(e).splitlines():
        if line.startswith("To append to your config use "):
            return f" ({line[0].lower()}{line[1:]})"
    return ""


def main() -> None:
    if sys.argv[1:2] == ["status"]:   # `expgpu status [DIR]`: a command of its own, not a Hydra override
        from expgpu.status import main as status

        sys.exit(status(sys.argv[2:]))
    if sys.argv[1:2] == ["report"]:   # `expgpu report DIR`, as `expgpu-report DIR`
        from expgpu.report import main as report

        sys.exit(report(sys.argv[2:], prog="expgpu report"))
    if sys.argv[1:2] == ["sbatch-script"]:   # `expgpu sbatch-script > expgpu.sbatch`, from any install
        sys.stdout.write(_shipped("scripts/expgpu.sbatch").read_text())
        return
    if sys.argv[1:] == ["--version"]:   # Hydra's own would say only "Hydra 1.3.8"
        print(_versions())
        return
    _before_hydra()
    import hydra

    from expgpu import rundir, schema

    schema.register()
    rundir.register()
    args = sys.argv[1:]
    if any(a in _PRINT_ONLY or a.split("=")[0] in _PRINT_ONLY for a in args):
        rundir.claim = False
    if any(a in ("-m", "--multirun") for a in args) and any(a in ("-c", "--cfg") for a in args):
        # Hydra ends this in a ValueError traceback
        print("expgpu: error: --cfg prints one config, not a sweep's: drop -m and give one job's overrides "
              "(e.g. python -m expgpu --cfg job task=b); each job of a sweep is composed the same way",
              file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    if _completion_for_python_m(args):
        return
    _skip_mode_composition(args)

    @hydra.main(config_path=conf_dir(), config_name="config", version_base="1.3")
    def _run(cfg) -> dict | None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from expgpu import app
        from expgpu.config import objective

        hc = HydraConfig.get()
        try:
            return objective(cfg, app.run(cfg, Path(hc.runtime.output_dir)))
        except Exception as e:
            # A single run ends here, so that Hydra adds no "Error executing job" line of its own
            # (SystemExit passes through its job runner). In a sweep the launcher reports the job.
            code = _report(e) if hc.mode == RunMode.RUN else None
            if code is None:
                raise
            sys.exit(code)

    try:
        _run()
    except KeyboardInterrupt:
        print("expgpu: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        code = _report(e)
        if code is None:
            raise
        sys.exit(code)
    finally:
        # What the run made lives until the process ends: the interpreter's last collections need not walk
        # it (a sweep's thousands of composed configs, a million objects each thousand: seconds at exit)
        gc.freeze()


def _before_hydra() -> None:
    """What must hold before Hydra and torch load (seconds)."""
    from expgpu.procs import stop_signals

    # A SIGTERM/SIGUSR2 from SLURM or a Ctrl-C in that time is kept and stops the run at its first
    # step, instead of killing it unsaved.
    stop_signals.install()
    faulthandler.enable(all_threads=True)  # a rank killed in C++ still says where Python was
    os.environ.setdefault(envvars.START_TIME, str(_T0))
    misspelt = envvars.misspelt(os.environ)
    if misspelt:
        print(f"expgpu: error: {misspelt}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    import warnings

    # conf/hydra/launcher/submitit_local.yaml has the name of hydra-submitit-launcher's schema, so
    # Hydra checks it against that schema and warns, three times, that such matching is deprecated.
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_local' is validated against")
    # Let Hydra's errors reach us instead of its multi-line report with exit code 1.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")


def _report(e: BaseException) -> int | None:
    """Print what ended the run as one line; its exit code, or None for a real bug (traceback)."""
    from expgpu.checkpoint.verify import NotExact
    from expgpu.errors import Hung, PeerLost, Stopped, WorkerFailed, no_room, no_room_line, said

    if isinstance(e, UserError):
        said(str(e))
        print(f"expgpu: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if isinstance(e, WorkerFailed):
        # a sweep's failed jobs were each named by its launcher's summary, once: no repeat here
        print("expgpu: the sweep failed (its failed jobs are listed above)" if getattr(e, "reported", False)
              else f"expgpu: {e}", file=sys.stderr)
        return 1
    if isinstance(e, (Stopped, Hung, PeerLost)):
        print(f"expgpu: {e}", file=sys.stderr)
        return e.exit_code
    if isinstance(e, NotExact):
        print(f"expgpu: {e}", file=sys.stderr)
        return 1
    if no_room(e):
        print(f"expgpu: error: {no_room_line(e)}", file=sys.stderr)
        return 1
    line = _one_line(e)
    if line is None:
        return None
    said(line)
    print(f"expgpu: error: {line}", file=sys.stderr)
    return EXIT_USER_ERROR


if __name__ == "__main__":
    main()
