"""Checkpoints that are never torn and never silently ignored.

save(): write to a temporary file in the same directory, fsync it, rename it over
the old one, fsync the directory. A crash at any point leaves either the old or the
new checkpoint, whole. load(): torch.load(weights_only=True), so a checkpoint can
hold tensors and plain containers only; anything unreadable or belonging to another
run shape is an error naming the file, never a restart from step 0.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from expgpu.errors import UserError
from expgpu.rundir import atomic_write_bytes

FORMAT = 2   # 2: the objects a run tracks (run.track), each rank's RNG and data position


def save(path: Path, state: dict[str, Any]) -> None:
    atomic_write_bytes(Path(path), dumps(state))


def dumps(state: dict[str, Any]) -> bytes:
    """The bytes save() writes (the sharded checkpoint's expgpu.pt is written by its own rename)."""
    import torch

    buf = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buf)
    return buf.getvalue()


# What a checkpoint must hold besides the run-shape keys that load() compares.
STATE_KEYS = ("step", "ranks", "tracked")


# What a tracked object's state_dict() may hold: what torch.load(weights_only=True) reads back.
_LOADABLE = "return tensors, numbers, strings and lists or dicts of them"


def _refused(why: str) -> str:
    """The type tensors-only loading refused, from _why_unreadable's line."""
    return why.split("weights_only=True): ", 1)[-1]


def check_loadable(name: str, state: Any) -> None:
    """`state` (a tracked object's state_dict) as a resume will read it, torch.load(weights_only=True),
    or a one-line error now, before training, rather than at the resume after a preemption."""
    import torch

    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:
        raise UserError(f"run.track({name}=...): its state_dict() holds what a resume cannot load "
                        f"({_refused(_why_unreadable(e))}); {_LOADABLE}") from None


def _why_unreadable(e: BaseException) -> str:
    """One line from torch.load's multi-paragraph errors."""
    text = str(e).strip()
    if "WeightsUnpickler error:" in text:  # not a pickle of tensors and plain containers
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().split(". ")[0]
        return f"not loadable with torch.load(weights_only=True): {' '.join(detail.split())}"
    if isinstance(e, EOFError):
        return "the file ends early (empty or truncated)"
    if isinstance(e, OSError):
        return f"cannot be read: {e.strerror or text}"
    first = text.splitlines()[0].split(". ")[0] if text else type(e).__name__
    return first


def load(path: Path, expect: dict[str, Any], params: dict[str, Any] | None = None,
         may_differ: dict[str, Any] | None = None, length: int | None = None,
         state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load and check that the checkpoint belongs to this run shape (task, world size, ...).

    `params` are the task settings behind expect["fingerprint"], to name the one that differs.
    `may_differ`: settings whose new value is the loop's length (a run trained on by the key that
    sets its length, the function's own max_iters or epochs): these alone may differ, and (where the
    checkpoint records the loop's length) by as much as `length`, the loop's length now, moved.
    Every failure is a UserError naming the file; the file itself is never touched, so a user
    can look at it, move it away, or point the run elsewhere. `state`: the file as read() read it.
    """
    path = Path(path)
    state = read(path) if state is None else state
    for key, want in expect.items():
        if state.get(key) != want:
            if key == "fingerprint":
                diffs = _settings_diff(state.get("params"), params)
                if diffs and all(_lengthens(k, old, new, may_differ, state.get("length"), length)
                                 for k, old, new in diffs):
                    continue
                raise UserError(f"checkpoint {path} was written with other task settings "
                                f"({_described(diffs)}); resume with the same settings or use a new run dir"
                                f"{_length_hint(may_differ)}")
            raise UserError(f"checkpoint {path} was written with {key}={state.get(key)!r}, "
                            f"this run has {key}={want!r}; resume with the same {key} or use a new run dir")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise UserError(f"checkpoint {path} lacks {', '.join(missing)}; {_HINT}")
    return state


_HINT = "move it away to start over, or point hydra.run.dir at another run"


def read(path: Path) -> dict[str, Any]:
    """The checkpoint at `path`, read with tensors-only loading, not yet checked against a run."""
    import torch

    hint = _HINT
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # zip/pickle errors name no file; we do
        why = _why_unreadable(e)
        if "Unsupported global" in why:   # whole, but holding an object of a type tensors-only loading refuses
            raise UserError(f"checkpoint {path} holds an object that torch.load(weights_only=True) does not read "
                            f"({_refused(why)}): a tracked object's state_dict() returned it; {_LOADABLE}, "
                            f"then {hint}") from None
        raise UserError(f"checkpoint {path} is corrupt or truncated ({why}); {hint}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} is not an expgpu checkpoint of format {FORMAT}; {hint}")
    return state


def length_keys(params: dict[str, Any], length: int) -> dict[str, int]:
    """The task keys whose value is the loop's length: the one that trains a finished run on.
    A loop that runs to its key inclusive (nanoGPT's `run.steps(None, max_iters + 1)`) has it at
    length - 1. A resume accepts a new value only where the length moved by as much (_lengthens)."""
    ints = {k: v for k, v in params.items() if isinstance(v, int) and not isinstance(v, bool)}
    for target in (length, length - 1):
        keys = {k: v for k, v in ints.items() if v == target}
        named = {k: v for k, v in keys.items() if _names_a_length(k)}
        if keys:
            return named or keys   # max_iters rather than an lr_decay_iters that equals it
    return {}


def _names_a_length(key: str) -> bool:
    return key.startswith(("max_", "num_", "n_")) or key in ("epochs", "steps", "iters", "iterations")


def _lengthens(key: str, old: Any, new: Any, lengths: dict[str, Any] | None, saved: int | None,
               now: int | None) -> bool:
    """Whether `key` going from `old` to `new` is the run's length changing: a length key, moved by
    as much as the loop's length (not an lr_decay_iters that happened to equal max_iters)."""
    if key not in (lengths or {}):
        return False
    if saved is None or now is None or not isinstance(old, int):   # an older checkpoint: no length kept
        return True
    return new - old == now - saved


def _settings_diff(saved: str | None, now: dict[str, Any] | None) -> list[tuple[str, Any, Any]] | None:
    """(key, saved value, value now) of every task setting that differs; None when not recorded."""
    import json

    if saved is None or now is None:
        return None
    before, after = json.loads(saved), json.loads(json.dumps(now, sort_keys=True, default=str))
    return [(k, before.get(k), after.get(k)) for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]


def _described(diffs: list[tuple[str, Any, Any]] | None) -> str:
    if diffs is None:
        return "the settings are not recorded"
    shown = [f"task.{k}={old!r}, now {new!r}" for k, old, new in _leaves(diffs)]
    return "; ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")


def _leaves(diffs: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """A differing section (task.model) as the keys in it that differ (task.model.hidden=128, now 64)."""
    out = []
    for key, old, new in diffs:
        if isinstance(old, dict) and isinstance(new, dict):
            inner = [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
            out += _leaves([(f"{key}.{k}", o, n) for k, o, n in inner])
        else:
            out.append((key, old, new))
    return out


def _length_hint(lengths: dict[str, Any] | None) -> str:
    """Which key trains a run on, when that is what the user was after."""
    if lengths:
        return f"; to train it on, change only {' or '.join(f'task.{k}' for k in sorted(lengths))}, its length"
    return ""
