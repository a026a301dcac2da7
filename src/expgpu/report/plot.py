"""loss_curves.png: every metric the jobs logged (metrics.jsonl), one panel each, for every job.

Panels in this order: the ranking metric, the training losses, the held-out metrics, the other
losses and scores, then the rest (learning rate, gradient norm, names of no known kind; report.rank
says how a name is read), each group in the order the jobs logged them; at most MAX_PANELS, the
ones left out named under the panels. The best job (report.rank) is drawn thick. Up to LEGEND_ALL
jobs each get a legend entry inside the first panel; beyond that only the best LEGEND_BEST are
named, in a legend beside the panels, and the others are thin grey lines: 42 entries in a legend
cover the plot and say nothing.
"""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path

from expgpu.report.best import Ranking, held_out, kind, measure
from expgpu.report.collect import Row

LEGEND_ALL = 12
LEGEND_BEST = 10
# 4 rows of 3: past that a panel is too small to read on a screen, and a sweep's own metrics
# come first anyway.
MAX_PANELS = 12


def pyplot():
    """matplotlib.pyplot on its Agg backend (no display: a file, from a terminal, a cluster node or CI).
    matplotlib's INFO lines ("generated new fontManager", at its first use on a machine) would read as the
    sweep's own among Hydra's: only its warnings are let through."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panels(rows: list[Row], ranking: Ranking) -> list[str]:
    """Every logged series, in the order to draw them (all of them: the caller caps)."""
    logged: list[str] = []
    for r in rows:
        logged += [name for name in r.series if name not in logged]

    def group(name: str) -> int:
        if _ranks(name, ranking):
            return 0
        if held_out(name):
            return 2
        return {"loss": 1, "score": 3}.get(kind(name), 4)

    return sorted(logged, key=lambda name: (group(name), logged.index(name)))


def _ranks(name: str, ranking: Ranking) -> bool:
    """The ranking metric's own series, or the series it was taken from (best_val_loss: val/loss)."""
    if ranking.metric is None:
        return False
    return name == ranking.metric or measure(name) == measure(ranking.metric) != ()


def _grid(n: int) -> tuple[int, int, float, float]:
    """Columns, rows and a panel's size in inches: 3 narrower columns past 4 panels, so that 12
    panels stay a picture of about 1700 x 1700 pixels."""
    cols = 1 if n == 1 else 2 if n <= 4 else 3
    width, height = (6.2, 4.2) if cols < 3 else (5.2, 3.6)
    return cols, math.ceil(n / cols), width, height


def plot(rows: list[Row], ranking: Ranking, path: Path, title: str) -> list[str] | None:
    """The legend's entries, best first; None when no job logged anything to draw."""
    names = panels(rows, ranking)
    if not names:
        return None
    names, left_out = names[:MAX_PANELS], names[MAX_PANELS:]
    plt = pyplot()
    drawn = [r for r in ranking.rows if any(r.series.get(n) for n in names)]
    crowded = len(drawn) > LEGEND_ALL
    named = set(id(r) for r in (ranking.rows[:min(LEGEND_BEST, ranking.n_ranked)] if crowded else drawn))
    if crowded and not named:
        named = set(id(r) for r in drawn[:LEGEND_BEST])
    # One colour per job for every panel: the legend, in the first panel only, names jobs by colour
    # (matplotlib's cycle would start again in each panel, over the jobs that logged that metric).
    colour = {id(r): f"C{i % 10}" for i, r in enumerate(r for r in drawn if id(r) in named)}
    cols, nrows, width, height = _grid(len(names))
    foot = 0.3 if left_out else 0.0   # inches for the line naming what was left out
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols + (3.2 if crowded else 0), height * nrows + 0.6 + foot),
                             dpi=110, squeeze=False)
    # Each named job's first line carries its legend entry, whichever panel it is in: the first
    # panel (the ranking metric's) may lack jobs that did not log it.
    entry: dict[int, object] = {}
    try:
        for ax, name in zip(axes.flat, names):
            _panel(ax, name, drawn, ranking, colour, entry)
        for ax in list(axes.flat)[len(names):]:
            ax.set_visible(False)
        handles = [entry[id(r)] for r in drawn if id(r) in entry]   # best first
        labels = [h.get_label() for h in handles]
        unfinished = any(r.status != "finished" for r in drawn)
        note = "* did not finish" if unfinished else None
        if crowded:
            fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.995 - 3.2 / fig.get_figwidth(), 0.5),
                       fontsize=7, title=f"best {len(labels)} of {len(drawn)} jobs" + (f"\n{note}" if note else ""),
                       title_fontsize=7, frameon=False)
        elif handles:
            axes.flat[0].legend(handles, labels, fontsize=7, loc="best", title=note, title_fontsize=7)
        common = " ".join(ranking.common)
        fig.suptitle(title + (f"\n{common}" if common else ""), fontsize=9)
        top = 1 - (0.42 if common else 0.28) / fig.get_figheight()   # tight_layout leaves the title no room
        if left_out:
            fig.text(0.01, 0.3 / fig.get_figheight(), f"not drawn ({MAX_PANELS} panels at most): "
                     + _shortened(", ".join(left_out), 40 * cols), fontsize=8, va="center")
        fig.tight_layout(rect=(0, foot / fig.get_figheight(), 1 - (3.2 / fig.get_figwidth() if crowded else 0), top))
        save(fig, path)
    finally:
        plt.close(fig)
    return labels


def _panel(ax, name: str, drawn: list[Row], ranking: Ranking, colour: dict, entry: dict) -> None:
    """One metric's curves, a line per job: the named jobs (`colour`'s) in their colours, the best one
    thick and on top, the others thin and grey; each named job's first line goes into `entry`."""
    for r in reversed(drawn):   # the best last: on top
        points = r.series.get(name)
        if not points:
            continue
        steps, values = zip(*points)
        best, labelled = r is ranking.best, id(r) in colour
        label = (f"#{r.job} " + " ".join(ranking.differs.get(r.job) or []))[:60]
        label += " *" if r.status != "finished" else ""
        style = dict(linewidth=2.6 if best else 1.3, zorder=3 if best else 2, color=colour.get(id(r)))
        if not labelled:
            style.update(color="0.7", linewidth=0.8, zorder=1)
        [line] = ax.plot(steps, values, marker="o" if len(steps) <= 3 else None, markersize=3, label=label, **style)
        if labelled:
            entry.setdefault(id(r), line)
    series = [v for r in drawn for _, v in r.series.get(name, [])]
    if kind(name) == "loss" and series and all(v > 0 for v in series):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title(name + (f"  ({ranking.direction})" if _ranks(name, ranking) else ""), fontsize=9)
    ax.grid(True, alpha=0.3)


def save(fig, path: Path) -> None:
    """The figure as a PNG at `path`, written atomically (a report read while it is rewritten is whole)."""
    from expgpu.rundir import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


def _shortened(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 3].rsplit(", ", 1)[0] + ", ..."
