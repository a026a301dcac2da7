"""optimization.png, for a sweep of hydra/sweeper=expgpu_optuna (its study.json): the optimization
history (the objective of each trial by trial number, the best so far as a line, pruned trials marked
at the last value they reported) and one panel per parameter against the objective. Read from
study.json alone: the report never needs Optuna."""

from __future__ import annotations

import json
import math
from pathlib import Path

from expgpu.report.plot import _grid, pyplot, save
from expgpu.rundir import STUDY

PNG = "optimization.png"


def read_study(sweep: Path) -> dict | None:
    try:
        doc = json.loads((Path(sweep) / STUDY).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("trials"), list) else None


def plot(doc: dict, path: Path, title: str) -> bool:
    """Draw it; False when no trial has a value to draw."""
    trials = [t for t in doc["trials"] if t.get("values") or t.get("last_value") is not None]
    if not trials:
        return False
    plt = pyplot()
    params = list(dict.fromkeys(k for t in doc["trials"] for k in (t.get("params") or {})))[:11]
    cols, nrows, width, height = _grid(1 + len(params))
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols, height * nrows + 0.5), dpi=110, squeeze=False)
    try:
        _history(axes.flat[0], doc)
        for ax, name in zip(list(axes.flat)[1:], params):
            _against(ax, doc, name)
        for ax in list(axes.flat)[1 + len(params):]:
            ax.set_visible(False)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
        save(fig, path)
    finally:
        plt.close(fig)
    return True


def _objective(doc: dict) -> tuple[str, bool]:
    return doc["objective"][0], doc["directions"][0] == "maximize"


def _history(ax, doc: dict) -> None:
    name, maximize = _objective(doc)
    done = [(t["number"], t["values"][0]) for t in doc["trials"] if t["state"] == "COMPLETE" and t.get("values")]
    pruned = [(t["number"], t["last_value"]) for t in doc["trials"]
              if t["state"] == "PRUNED" and t.get("last_value") is not None]
    if done:
        ax.scatter(*zip(*done), s=18, color="C0", label="complete", zorder=3)
        best, line = None, []
        for number, value in sorted(done):
            best = value if best is None or (value > best if maximize else value < best) else best
            line.append((number, best))
        last = max(t["number"] for t in doc["trials"])
        line.append((max(last, line[-1][0]), best))   # the best stands until the last trial
        ax.step(*zip(*line), where="post", color="C1", label="best so far", zorder=2)
    if pruned:
        ax.scatter(*zip(*pruned), s=26, marker="x", color="C3", label="pruned (last reported)", zorder=3)
    ax.set_xlabel("trial")
    ax.set_title(f"{name} by trial ({'higher' if maximize else 'lower'} is better)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)


def _against(ax, doc: dict, param: str) -> None:
    name, _ = _objective(doc)
    points = [(t["params"][param], t["values"][0], False) for t in doc["trials"]
              if t["state"] == "COMPLETE" and t.get("values") and param in (t.get("params") or {})]
    points += [(t["params"][param], t["last_value"], True) for t in doc["trials"]
               if t["state"] == "PRUNED" and t.get("last_value") is not None and param in (t.get("params") or {})]
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x, _, _ in points)
    if not numeric:   # categorical: one position per choice, in the order first seen
        labels = list(dict.fromkeys(str(x) for x, _, _ in points))
        points = [(labels.index(str(x)), y, p) for x, y, p in points]
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
    for was_pruned, style in ((False, dict(s=18, color="C0")), (True, dict(s=26, marker="x", color="C3"))):
        chosen = [(x, y) for x, y, p in points if p == was_pruned]
        if chosen:
            ax.scatter(*zip(*chosen), **style)
    xs = [x for x, _, _ in points]
    if numeric and xs and min(xs) > 0 and max(xs) / min(xs) > 100:
        ax.set_xscale("log")
    ax.set_xlabel(param, fontsize=8)
    ax.set_title(f"{name} against {param}", fontsize=9)
    ax.grid(True, alpha=0.3)
    if not points or not all(math.isfinite(y) for _, y, _ in points):
        ax.set_title(f"{param}: nothing to draw", fontsize=9)
