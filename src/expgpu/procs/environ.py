"""This process's own environment, changed for a while and put back."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def kept(*names: str) -> Iterator[dict[str, str | None]]:
    """os.environ's `names` as they are now (None: unset), put back on the way out, whatever the block set."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield before
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
