"""Resuming on another number of ranks: what a checkpoint written by W ranks gives each of W' ranks.

Nothing here reads or writes a file: it works on the checkpoint's state as a dict (the "ranks"
list, one entry per rank that saved, and the world sizes recorded beside it), so the rule is the
same whatever format holds that state.

The rules (docs/stopping-and-resume.md, "Resuming on another number of ranks / GPUs"):
- The model, optimizer and every object tracked from rank 0 load at any world size (DDP keeps
  the ranks' copies equal).
- The global batch stays fixed. A batch size given to run.loader (and task.batch_size) is per rank
  at the world size the run STARTED with (recorded in the checkpoint as start_world_size and
  carried from resume to resume); at W' ranks each rank takes global / W'. A W' that does not
  divide the global batch is one line, exit 2.
- The data continues at the same global sample. run.loader's ranks take interleaved shares of one
  permutation per epoch, so batch k of every rank is positions [kG, (k+1)G) of it (G the global
  batch) whatever the world size: the position in batches (rank 0's) is a global position.
- RNG states: a rank's saved state belongs to a rank that no longer exists as it was, so on a
  world change every rank's generators are reseeded from (task.seed, step, rank): deterministic,
  and rank-dependent exactly as the run's start was (task.seed_per_rank).
- A rank's own tracked values (a dict given to run.track, keep= loop variables) carry over when
  every saved rank held the same value (an all-reduced best, a step counter); values that differ
  between ranks have no rank to go to: one line, exit 2.
"""

from __future__ import annotations

import hashlib
from typing import Any

from expgpu.errors import UserError


def saved_world(state: dict) -> int:
    """How many ranks wrote `state`."""
    return len(state["ranks"])


def start_world(state: dict | None, world: int) -> int:
    """The world size the run started with: what its per-rank batch sizes are counted at."""
    if state is None:
        return world
    return int(state.get("start_world_size") or state.get("world_size") or saved_world(state))


def changed(state: dict, world: int) -> bool:
    return saved_world(state) != world


def rank_batch(batch_size: int, start: int, world: int) -> int | None:
    """The per-rank batch at `world` ranks that keeps the global batch (batch_size x start); None
    when `world` does not divide it."""
    total = batch_size * start
    return total // world if total % world == 0 else None


def indivisible(what: str, batch_size: int, start: int, world: int) -> str:
    total = batch_size * start
    fits = ", ".join(str(w) for w in range(1, total + 1) if total % w == 0 and w <= 64)
    return (f"with {what}={batch_size} per rank x {start} rank(s) at its start = a global batch of {total}, which "
            f"{world} ranks cannot share equally; resume on a number of ranks that divides {total} ({fits}), "
            "or use a new run dir")


def where(state: dict, rank: int, world: int) -> tuple[int, int]:
    """(epoch, batch position) at which `rank` of `world` ranks resumes."""
    mine = state["ranks"][rank if not changed(state, world) else 0]
    return mine["epoch"], mine["position"]


def reseed_value(seed: int, step: int, rank: int, per_rank: bool) -> int:
    """The seed of `rank`'s generators after a resume on another world size, at `step`."""
    digest = hashlib.blake2b(f"world-change/{seed}/{step}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little") + (rank if per_rank else 0)


def own_value(state: dict, name: str, rank: int, world: int, path: Any) -> Any:
    """This rank's own saved value of the per-rank tracked object `name`, or None when the
    checkpoint holds none (then rank 0's shared state is used)."""
    ranks = state["ranks"]
    if not changed(state, world):
        return ranks[rank].get("tracked", {}).get(name)
    values = [r.get("tracked", {}).get(name) for r in ranks]
    if all(v is None for v in values):
        return None
    first = values[0]
    if all(same(first, v) for v in values[1:]):
        return first
    label = f"keep= variables of {name.split(':', 1)[1]}" if name.startswith("keep:") else f"run.track({name}=...)"
    raise UserError(f"checkpoint {path}: its {len(ranks)} ranks each hold their own {label} and the values differ, "
                    f"so they cannot be given to {world} rank(s); resume with {len(ranks)} ranks, or make the "
                    "values equal on every rank (all-reduce them) before the run stops")


def same(a: Any, b: Any) -> bool:
    """Equal values, tensors compared element for element (nested in lists, tuples and dicts)."""
    if hasattr(a, "shape") and hasattr(b, "shape"):
        import torch

        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
