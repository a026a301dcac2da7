"""What every place rows go shares: the Sink a MetricsLog feeds, and the reading of a row, a result and
a config that every logger back end does alike.

A Sink gets rank 0's rows exactly as metrics.jsonl gets them (same steps, same values): started once
before the first row, fed each flush's rows, finished with how the run ended. The chosen loggers are
one (expgpu.loggers.Loggers), an optimizing sweeper's trial another (expgpu.tune.bridge): MetricsLog
is handed them (by the worker) and knows neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from expgpu.loggers.progress import FIELDS


class Sink:
    # The names whose rows this sink wants at their flush, not at the next write-out (up to
    # expgpu.loggers.jsonl.WRITE_EVERY_S later): a pruner's objective, which may end the run.
    prompt: frozenset[str] = frozenset()

    def start(self, resumed: bool, step: int, flushed_before: int, jsonl: Path) -> None:
        """At the first row of this process. `resumed`: from a checkpoint at `step`;
        `flushed_before`: the last step metrics.jsonl held before it was trimmed to `step`."""

    def write(self, rows: list[dict]) -> None:
        raise NotImplementedError

    def finish(self, status: str, metrics: dict, step: int, last_row: dict | None) -> None:
        """status: finished, pruned (an optimizing sweeper's pruner ended it: final), diverged (its loss became nan
        under task.on_nonfinite=stop: final), stopped (resumable) or failed; metrics: what the task returned."""


_NOT_METRICS = frozenset({"step", "time", *FIELDS})


def values(row: dict) -> dict[str, Any]:
    """A metrics.jsonl row's metrics: everything but its step, wall time and progress fields (epoch included)."""
    return {k: v for k, v in row.items() if k not in _NOT_METRICS}


def final_metrics(metrics: dict, last_row: dict) -> dict[str, float]:
    """The returned metrics a logger's history lacks: those the last row does not already hold at
    the same value (eval_loss logged at the last step and returned would be a second point)."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and last_row.get(k) != v}


def hyperparameters(cfg: dict) -> dict[str, Any]:
    """The resolved config, flat (task.optimizer.lr: 0.001), values as numbers, bools or strings."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, (bool, int, float, str)):
            flat[prefix] = node
        else:
            flat[prefix] = json.dumps(node, default=str)   # None, lists, {}: as written in JSON

    walk("", {k: v for k, v in cfg.items() if k != "logger"})
    return flat
