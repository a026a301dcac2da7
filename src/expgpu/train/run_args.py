"""The arguments of run.steps and run.epochs, checked before a loop begins: a wrong one is one
line (UserError) that names it and says what is allowed, never a traceback from inside the loop."""

from __future__ import annotations

from expgpu.errors import UserError


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_steps(max_steps, accumulate, in_epochs: bool, begun: bool) -> None:
    """run.steps(loader, max_steps, accumulate): `in_epochs`, called inside run.epochs; `begun`,
    the run's loop of steps has begun already."""
    if not _count(accumulate) or accumulate < 1:
        raise UserError(f"run.steps: accumulate={accumulate!r} is not allowed: an integer >= 1")
    if in_epochs:
        if max_steps is not None:
            raise UserError("run.steps(loader, max_steps): inside run.epochs, run.steps(loader) is one epoch, "
                            "as long as the loader; leave max_steps out (or break out of the loop)")
        return
    if begun:
        raise UserError("run.steps: called a second time; a run has one training loop (for a loop over "
                        "epochs: for epoch in run.epochs(n): for step, batch in run.steps(loader): ...)")
    if max_steps is None:
        raise UserError("run.steps(loader): max_steps is missing; run.steps(loader, max_steps), or "
                        "run.steps(loader) inside `for epoch in run.epochs(n)` for one epoch at a time")
    if not _count(max_steps) or max_steps < 0:
        raise UserError(f"run.steps: max_steps={max_steps!r} is not allowed: an integer >= 0")


def epochs_range(n, stop, begun: bool) -> tuple[int, int]:
    """run.epochs(n) or run.epochs(n, stop): (start, stop) as range() takes them."""
    if begun:
        raise UserError("run.epochs: the run's training loop has begun already; a run has one")
    start, stop = (0, n) if stop is None else (n, stop)
    for name, value in (("start", start), ("stop", stop)):
        if not _count(value) or value < 0:
            raise UserError(f"run.epochs: {name}={value!r} is not allowed: an integer >= 0")
    return start, stop
