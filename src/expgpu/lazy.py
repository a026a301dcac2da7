"""Names a package exports but imports only on their first use (PEP 562's module __getattr__): what a
package's __init__ would otherwise import for every process that touches the package (every run's start
imports expgpu, expgpu.status and expgpu.report, and needs none of Run, the status reader or the ranking)."""

from __future__ import annotations

import importlib
from typing import Callable, Mapping


def names(package: str, where: Mapping[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package`: name -> the module (relative to the package) it is imported from."""
    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__
