"""Which job was best: the metric a sweep is judged by, the jobs in its order, what tells them apart.

The metric is `--metric NAME` (expgpu-report's option), else the jobs' `objective` (the first,
for several), else one of the metrics the finished jobs returned (result.json), chosen in this
order:

1. the metric the most finished jobs returned (as a finite number): one that some jobs lack
   ranks only those that have it;
2. a metric whose name says its kind (KINDS below): a loss (minimized) or a score (maximized);
3. a held-out metric: a word of its name is one of HELD_OUT;
4. any metric before `final_loss` (the built-in loop's last training step);
5. the order the jobs returned them.

A name's words are split at `/ _ . - @ :` and where lower case turns upper (`val/loss`,
`eval.acc`, `test_top1`, `valLoss`); the words best, min, max, final, last, mean and avg say
which value it is, not what it measures (`best_val_loss` and `val_loss_best` are held-out
losses); the last word that names a kind decides it (`top1_err` is a loss). A metric of no known
kind is minimized, and the report's first line says that this is a guess.

Which way is better: `--maximize` / `--minimize`, else an optimizing sweeper's direction for the
objective (.hydra/hydra.yaml), else the name's kind. Finished jobs with the metric come first,
best first; the others follow in job order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from expgpu.report.collect import Row

HELD_OUT = frozenset({"val", "valid", "validation", "eval", "evaluation", "test", "dev", "heldout", "holdout"})
# Whole words; the last one in a name that matches decides its kind.
KINDS = {
    "loss": re.compile(r"loss(es)?|nll|perplexity|ppl|error|errors|err|mse|mae|rmse|mape|cer|wer|bpc|bpd|fid"),
    "score": re.compile(r"acc|accuracy|f1|auc|auroc|precision|recall|score|bleu|rouge\w*|m?iou|m?ap\d*|r2|"
                        r"rewards?|top\d+|ndcg\w*|psnr|ssim|dice"),
}
# Words about which value of a series a metric is, not what it measures.
_NEUTRAL = frozenset({"best", "min", "max", "final", "last", "mean", "avg"})
_LAST_RESORT = "final_loss"


def words(name: str) -> list[str]:
    """`val/loss` -> [val, loss]; `valLoss` -> [val, loss]; `test_top1` -> [test, top1]."""
    split = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    return [w for w in re.split(r"[/_.\-@:\s]+", split) if w]


def measure(name: str) -> tuple[str, ...]:
    """What a metric measures: its words but those saying which value it is (`best_val_loss` and
    the series `val/loss` both measure (val, loss))."""
    return tuple(w for w in words(name) if w not in _NEUTRAL)


def kind(name: str) -> str | None:
    """"loss", "score", or None when no word of the name says."""
    found = None
    for word in measure(name):
        for k, pattern in KINDS.items():
            if pattern.fullmatch(word):
                found = k
    return found


def held_out(name: str) -> bool:
    return not HELD_OUT.isdisjoint(words(name))


def maximized(name: str) -> bool:
    """The name rule's direction: a score is maximized, a loss or a name of no known kind minimized."""
    return kind(name) == "score"


@dataclass
class Ranking:
    metric: str | None
    maximize: bool
    rows: list[Row]              # best first
    n_ranked: int                # the first n_ranked rows have the metric; the rest follow in job order
    best: Row | None
    common: list[str]            # overrides every job shares
    differs: dict[str, list[str]]  # job -> its overrides that not every job shares
    why: str = ""                # why this metric, for the report's first line
    assumed: bool = False        # the direction is a guess: the name says neither loss nor score

    @property
    def direction(self) -> str:
        return "higher is better" if self.maximize else "lower is better"


def _value(row: Row, metric: str | None) -> float | None:
    if metric is None or row.status != "finished":
        return None
    v = row.metrics.get(metric)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _sweeper_way(rows: list[Row], name: str) -> bool | None:
    """An optimizing sweeper's direction for `name`, when it is one of the jobs' objectives."""
    for r in rows:
        if r.maximize and name in r.objective:
            i = r.objective.index(name)
            if i < len(r.maximize):
                return r.maximize[i]
    return None


def _preference(name: str) -> tuple[bool, bool, bool]:
    """Rule steps 2-4, as a sort key (smaller first)."""
    return kind(name) is None, not held_out(name), name == _LAST_RESORT


def _described(name: str) -> str:
    what = kind(name) or "metric"
    return f"a held-out {what}" if held_out(name) else ("the training loss" if name == _LAST_RESORT else f"a {what}")


def choose_metric(rows: list[Row]) -> tuple[str | None, str]:
    """The returned metric the rule picks, and why, in words; (None, why) when none was returned."""
    finished = [r for r in rows if r.status == "finished"]
    order: list[str] = []
    for r in finished:
        order += [k for k in r.metrics if k not in order and _value(r, k) is not None]
    if not order:
        return None, "no finished job returned a number" if finished else "no job finished"
    count = {name: sum(_value(r, name) is not None for r in finished) for name in order}
    chosen = min(order, key=lambda n: (-count[n], *_preference(n), order.index(n)))
    n, total = count[chosen], len(finished)
    how_many = "every finished job returned" if n == total else f"{n} of {total} finished jobs returned, the most"
    why = f"chosen: {_described(chosen)} that {how_many}"
    # The metric the name rule alone would have picked, passed over because fewer jobs returned it.
    preferred = min(order, key=lambda n: (*_preference(n), -count[n], order.index(n)))
    if _preference(preferred) < _preference(chosen):
        why += f" ({preferred}: only {count[preferred]} of {total})"
    return chosen, why + "; objective= or --metric choose another"


def rank(rows: list[Row], metric: str | None = None, maximize: bool | None = None) -> Ranking:
    objective = next((r.objective[0] for r in rows if r.objective), None)
    if metric is not None:
        chosen, why = metric, "chosen by --metric"
    elif objective is not None:
        chosen, why = objective, "the jobs' objective"
    else:
        chosen, why = choose_metric(rows)
    way, assumed = maximize, False
    if way is None and chosen is not None:
        way = _sweeper_way(rows, chosen)
    if way is None:
        way, assumed = maximized(chosen or ""), chosen is not None and kind(chosen) is None
    scored = [r for r in rows if _value(r, chosen) is not None]
    scored.sort(key=lambda r: -_value(r, chosen) if way else _value(r, chosen))   # stable: ties in job order
    rest = [r for r in rows if _value(r, chosen) is None]
    ordered = scored + rest
    common = [o for o in rows[0].overrides if all(o in r.overrides for r in rows)] if len(rows) > 1 else []
    differs = {r.job: [o for o in r.overrides if o not in common] for r in rows}
    return Ranking(chosen, way, ordered, len(scored), scored[0] if scored else None, common, differs, why, assumed)


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
