"""Which job was best: the metric a sweep is judged by, the jobs in its order, what tells them apart.

The metric is the jobs' `objective` (the first, for several), else the first of eval_loss,
eval_accuracy, accuracy, final_loss that a job returned. Lower is better, unless an optimizing
sweeper was told to maximize (.hydra/hydra.yaml) or the name says a score (accuracy, f1, ...);
`--metric` and `--maximize` choose by hand. Finished jobs with the metric come first, best first;
the others follow in job order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from expgpu.report.collect import Row

_FALLBACK = ("eval_loss", "eval_accuracy", "accuracy", "final_loss")
_HIGHER_IS_BETTER = re.compile(r"acc|f1|auc|precision|recall|score|bleu|rouge|iou|map\b|r2|reward|modes", re.I)


@dataclass
class Ranking:
    metric: str | None
    maximize: bool
    rows: list[Row]              # best first
    n_ranked: int                # the first n_ranked rows have the metric; the rest follow in job order
    best: Row | None
    common: list[str]            # overrides every job shares
    differs: dict[str, list[str]]  # job -> its overrides that not every job shares

    @property
    def direction(self) -> str:
        return "higher is better" if self.maximize else "lower is better"


def _value(row: Row, metric: str | None) -> float | None:
    if metric is None or row.status != "finished":
        return None
    v = row.metrics.get(metric)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def choose_metric(rows: list[Row]) -> tuple[str | None, bool]:
    objective = next((r.objective[0] for r in rows if r.objective), None)
    if objective is not None:
        way = next((r.maximize[0] for r in rows if r.objective and r.maximize), None)
        return objective, bool(_HIGHER_IS_BETTER.search(objective)) if way is None else way
    for name in _FALLBACK:
        if any(_value(r, name) is not None for r in rows):
            return name, bool(_HIGHER_IS_BETTER.search(name))
    return None, False


def rank(rows: list[Row], metric: str | None = None, maximize: bool | None = None) -> Ranking:
    chosen, way = choose_metric(rows) if metric is None else (metric, bool(_HIGHER_IS_BETTER.search(metric)))
    if maximize is not None:
        way = maximize
    scored = [r for r in rows if _value(r, chosen) is not None]
    scored.sort(key=lambda r: -_value(r, chosen) if way else _value(r, chosen))   # stable: ties in job order
    rest = [r for r in rows if _value(r, chosen) is None]
    ordered = scored + rest
    common = [o for o in rows[0].overrides if all(o in r.overrides for r in rows)] if len(rows) > 1 else []
    differs = {r.job: [o for o in r.overrides if o not in common] for r in rows}
    return Ranking(chosen, way, ordered, len(scored), scored[0] if scored else None, common, differs)


def place(row: Row, ranking: Ranking) -> int | None:
    """1 for the best job, 2 for the next, ...; None for a job without the metric."""
    i = next(i for i, r in enumerate(ranking.rows) if r is row)
    return i + 1 if i < ranking.n_ranked else None


def metric_columns(rows: list[Row], first: str | None) -> list[str]:
    """Every metric any job returned, the ranking metric first, then in the order jobs returned them."""
    names = [first] if first else []
    for r in rows:
        names += [k for k in r.metrics if k not in names]
    return names
