"""loss_curves.png: the training loss and the evaluation metrics of every job, one panel each.

The best job (report.rank) is drawn thick. Up to LEGEND_ALL jobs each get a legend entry inside the
first panel; beyond that only the best LEGEND_BEST are named, in a legend beside the panels, and
the others are thin grey lines: 42 entries in a legend cover the plot and say nothing.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from expgpu.report.collect import Row
from expgpu.report.rank import Ranking

LEGEND_ALL = 12
LEGEND_BEST = 10
MAX_PANELS = 4


def panels(rows: list[Row], ranking: Ranking) -> list[str]:
    """Which logged series to draw: loss, the ranking metric, then evaluation metrics."""
    logged = [name for r in rows for name in r.series]
    wanted = ["loss", ranking.metric or ""]
    wanted += [n for n in logged if n.startswith(("eval_", "train_")) or n in ("accuracy", "val_loss")]
    out = []
    for name in wanted:
        if name in logged and name not in out:
            out.append(name)
    return out[:MAX_PANELS]


def plot(rows: list[Row], ranking: Ranking, path: Path, title: str) -> list[str] | None:
    """The legend's entries, best first; None when no job logged anything to draw."""
    names = panels(rows, ranking)
    if not names:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display: a file, from a terminal, a cluster node or CI
    import matplotlib.pyplot as plt

    from expgpu.rundir import atomic_write_bytes

    drawn = [r for r in ranking.rows if any(r.series.get(n) for n in names)]
    crowded = len(drawn) > LEGEND_ALL
    named = set(id(r) for r in (ranking.rows[:min(LEGEND_BEST, ranking.n_ranked)] if crowded else drawn))
    if crowded and not named:
        named = set(id(r) for r in drawn[:LEGEND_BEST])
    # One colour per job for every panel: the legend, in the first panel only, names jobs by colour
    # (matplotlib's cycle would start again in each panel, over the jobs that logged that metric).
    colour = {id(r): f"C{i % 10}" for i, r in enumerate(r for r in drawn if id(r) in named)}
    cols = min(len(names), 2)
    nrows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols + (3.2 if crowded else 0), 4.2 * nrows + 0.6),
                             dpi=110, squeeze=False)
    try:
        for ax, name in zip(axes.flat, names):
            for r in reversed(drawn):   # the best last: on top
                points = r.series.get(name)
                if not points:
                    continue
                steps, values = zip(*points)
                best, labelled = r is ranking.best, id(r) in named
                label = (f"#{r.job} " + " ".join(ranking.differs.get(r.job) or []))[:60]
                label += " *" if r.status != "finished" else ""
                style = dict(linewidth=2.6 if best else 1.3, zorder=3 if best else 2, color=colour.get(id(r)))
                if not labelled:
                    style.update(color="0.7", linewidth=0.8, zorder=1)
                ax.plot(steps, values, marker="o" if len(steps) <= 3 else None, markersize=3,
                        label=label if labelled and ax is axes.flat[0] else None, **style)
            series = [v for r in drawn for _, v in r.series.get(name, [])]
            if name.endswith("loss") and series and all(v > 0 for v in series):
                ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_title(name + (f"  ({ranking.direction})" if name == ranking.metric else ""), fontsize=9)
            ax.grid(True, alpha=0.3)
        for ax in list(axes.flat)[len(names):]:
            ax.set_visible(False)
        handles, labels = axes.flat[0].get_legend_handles_labels()
        order = sorted(range(len(labels)), key=lambda i: -i)   # drawn worst first: list best first
        handles, labels = [handles[i] for i in order], [labels[i] for i in order]
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
        fig.tight_layout(rect=(0, 0, 1 - (3.2 / fig.get_figwidth() if crowded else 0), 1))
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return labels
