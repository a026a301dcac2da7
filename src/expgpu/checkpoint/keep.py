"""`keep=`: the local variables a loop carries from one step (or epoch) to the next, kept by the
checkpoint and put back on a resume.

A script's loop carries state in plain variables: an RNN's hidden state, a batch fetched at the end
of a step for the next one (nanoGPT), the best validation loss so far, a learning rate the end of an
epoch anneals, a running sum it prints. Moving each into a tracked dict means editing every line
that uses it; `run.steps(loader, keep=("hidden",))` names them instead and leaves those lines as
they are. `KeptLocals` reads the named variables of the function that started the loop whenever
a checkpoint is saved (each rank its own values), and writes them back into that function when a
resumed run reaches the point the checkpoint was taken at.

Writing a function's variables from outside it is CPython's frame API, as debuggers use it:
`frame.f_locals` is a write-through mapping from Python 3.13 (PEP 667); before, it is a snapshot
that PyFrame_LocalsToFast copies back into the frame.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Iterable

from expgpu.checkpoint.tensors import placed_like
from expgpu.errors import UserError


def names_of(keep: str | Iterable[str], where: str) -> tuple[str, ...]:
    """`keep` as a tuple of names: one name, names separated by spaces or commas, or a sequence."""
    names = keep.replace(",", " ").split() if isinstance(keep, str) else list(keep)
    if not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise UserError(f"{where}: keep={keep!r} is not allowed: the names of the loop's own variables, "
                        "e.g. keep=('hidden', 'best_val_loss')")
    return tuple(names)


class KeptLocals:
    """The named local variables of one function's frame, as a tracked object of a rank's own."""

    per_rank = True   # each rank saves and gets back its own values (checkpoint.state.CheckpointState)

    def __init__(self, names: tuple[str, ...], where: str):
        self.names, self.where = names, where
        self.frame: FrameType | None = None

    def bind(self, frame: FrameType) -> None:
        """The frame whose variables these are (a function called again each epoch: its new call)."""
        code = frame.f_code
        variables = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
        missing = [n for n in self.names if n not in variables]
        if missing:
            has = ", ".join(sorted(v for v in variables if not v.startswith("_"))) or "none"
            raise UserError(f"{self.where}: keep names {', '.join(missing)}, which {code.co_name}() has no "
                            f"local variable of; it has {has}")
        self.frame = frame

    def state_dict(self) -> dict[str, Any]:
        """The variables bound now (one not assigned yet is left out)."""
        values = self.frame.f_locals if self.frame is not None else {}
        return {n: values[n] for n in self.names if n in values}

    def load_state_dict(self, state: dict[str, Any]) -> None:

        if self.frame is None:
            return
        current = self.frame.f_locals
        _write(self.frame, {n: placed_like(v, current.get(n)) for n, v in state.items() if n in self.names})


def _write(frame: FrameType, values: dict[str, Any]) -> None:
    if not values:
        return
    if sys.version_info >= (3, 13):
        for name, value in values.items():
            frame.f_locals[name] = value
        return
    import ctypes

    frame.f_locals.update(values)
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
