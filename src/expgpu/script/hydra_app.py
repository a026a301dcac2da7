"""A script that is a Hydra app (`@hydra.main`, as pytorch/examples' minGPT-ddp): task.args as its
key=value overrides (args_style=hydra), and its own Hydra kept inside expgpu's run dir.

The run dir is the script's working directory. Left to itself, the script's Hydra makes a dir of its
own under it (outputs/<date>/<time>: one a rank when the ranks start across a second, a new one on a
rerun, where a checkpoint saved relative to it is then not found and the run starts over), or, with
its run dir set to `.` as minGPT-ddp's is, writes its .hydra/ over expgpu's, whose overrides and
objective the sweep report reads. So it runs with OWN first: its outputs in the run dir, its composed
config in .hydra/script/; the user's own overrides of these come after and win.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from pathlib import Path
from typing import Any

from expgpu.errors import UserError, first_line

OWN = ["hydra.run.dir=.", "hydra.output_subdir=.hydra/script"]


def main_line(path: str | Path | None) -> int | None:
    """The line of the script's @hydra.main (or `from hydra import main` and @main), None if no function of it
    has one, or it cannot be read or parsed (its own run then says what is wrong with it)."""
    if path is None:
        return None
    try:
        tree = ast.parse(Path(path).read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "hydra"
             for a in n.names if a.name == "main"}
    for node in ast.walk(tree):
        for d in getattr(node, "decorator_list", ()):
            f = d.func if isinstance(d, ast.Call) else d
            if (isinstance(f, ast.Attribute) and f.attr == "main" and isinstance(f.value, ast.Name)
                    and f.value.id == "hydra") or (isinstance(f, ast.Name) and f.id in names):
                return d.lineno
    return None


def override(key: str, value: Any, where: str) -> str:
    """key=value as Hydra's override parser reads it back to this very value: a string quoted only where
    it would read as something else ('1e-3', 'true', 'a,b', which Hydra would sweep), a list in [..].
    A key may begin with Hydra's + (add), ++ (add or override) or ~ (delete; `~key: null` alone)."""
    if key.startswith("~") and value is None:
        return _parsed(key, None, where, delete=True)
    return _parsed(f"{key}={_text(value)}", value, where)


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if _reads_back(value):
        return value
    # a quoted string: \ escapes a quote, and the backslashes just before one
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body) + "'"


def _reads_back(text: str) -> bool:
    error, sweep, value = _parse(f"k={text}")
    return error is None and not sweep and _same(value, text)


def _parsed(text: str, value: Any, where: str, delete: bool = False) -> str:
    error, sweep, read = _parse(text)
    if error is not None:
        raise UserError(f"{where}: {text} is not a Hydra override ({error}); args_style=hydra writes "
                        "each key as key=value (+key to add one, ~key to delete)")
    if not delete and (sweep or not _same(read, value)):
        raise UserError(f"{where}={value!r} cannot be written as a Hydra override that reads back the same "
                        f"(it would read {'a sweep' if sweep else repr(read)}); pass it as a string")
    return text


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[str | None, bool, Any]:
    """(why Hydra's parser refuses it, or None; whether it is a sweep; its value). Cached: a sweep's jobs are
    checked one by one with mostly the same arguments (~0.4 ms a parse)."""
    try:
        parsed = _parser().parse_override(text)
    except Exception as e:
        return first_line(e), False, None
    return None, parsed.is_sweep_override(), None if parsed.is_sweep_override() else parsed.value()


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, float) and isinstance(got, float) and math.isnan(want):
        return math.isnan(got)
    return type(got) is type(want) and got == want


_PARSER = None


def _parser():
    global _PARSER
    if _PARSER is None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        _PARSER = OverridesParser.create()
    return _PARSER
