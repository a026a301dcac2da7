"""User-facing errors: one line, exit code 2, never a traceback."""

from __future__ import annotations

import re


class UserError(Exception):
    """Bad input from the user (config value, environment variable, GPU id, cluster setting).

    The message is one line that names what is wrong and what is allowed; the entry point
    prints it as ``expgpu: error: <message>`` and exits with EXIT_USER_ERROR.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # always one line


EXIT_USER_ERROR = 2


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none)."""
    text = str(e).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(e).__name__


def env_int(env, name: str, *, minimum: int = 0) -> int:
    """Read an integer environment variable, naming it when it is malformed."""
    raw = env.get(name)
    if raw is None:
        raise UserError(f"environment variable {name} is not set")
    # int() alone would also take "1_0" and non-ASCII digits, which no launcher writes
    if not re.fullmatch(r"-?[0-9]+", raw.strip()):
        raise UserError(f"environment variable {name}={raw!r} is not an integer (must be an integer >= {minimum})")
    value = int(raw)
    if value < minimum:
        raise UserError(f"environment variable {name}={raw!r} must be >= {minimum}")
    return value
