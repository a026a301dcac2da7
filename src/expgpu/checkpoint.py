"""Checkpoints that are never torn and never silently ignored.

save(): write to a temporary file in the same directory, fsync it, rename it over
the old one, fsync the directory. A crash at any point leaves either the old or the
new checkpoint, whole. load(): torch.load(weights_only=True), so a checkpoint can
hold tensors and plain containers only; anything unreadable or belonging to another
run shape is an error naming the file, never a restart from step 0.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from expgpu.errors import UserError

FORMAT = 1
FILENAME = "checkpoint.pt"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save(path: Path, state: dict[str, Any]) -> None:
    import torch

    buf = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


def load(path: Path, expect: dict[str, Any]) -> dict[str, Any]:
    """Load and check that the checkpoint belongs to this run shape (task, world size, ...)."""
    import torch

    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # zip/pickle errors name no file; we do
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path} is corrupt or truncated ({first}); "
                        f"move it away to start over, or point hydra.run.dir at a good run") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} is not an expgpu checkpoint of format {FORMAT}")
    for key, want in expect.items():
        if state.get(key) != want:
            raise UserError(f"checkpoint {path} was written with {key}={state.get(key)!r}, "
                            f"this run has {key}={want!r}; resume with the same {key} or use a new run dir")
    return state
