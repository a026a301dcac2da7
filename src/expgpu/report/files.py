"""The files a sweep report writes into the sweep dir: their names (which expgpu status reads too), and
`write()`, which the command, the live page and the sweep's end share."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from expgpu.report.best import Ranking
    from expgpu.report.collect import Row
    from expgpu.report.state import Progress

CSV_FILE = "report.csv"
PNG_FILE = "loss_curves.png"
HTML_FILE = "report.html"


def write(sweep: Path, rows: list[Row], ranking: Ranking, plot: bool = True,
          progress: Progress | None = None) -> list[Path]:
    """report.csv, loss_curves.png (unless plot=False, or nothing was logged) and report.html; `progress`:
    where the sweep stands, said at the top of the page (a running sweep's page reloads itself)."""
    from expgpu.report import history, html, table
    from expgpu.report.plot import plot as draw

    written = [sweep / CSV_FILE]
    table.write_csv(rows, ranking, sweep / CSV_FILE)
    pngs = []
    if plot and draw(rows, ranking, sweep / PNG_FILE, str(sweep)) is not None:
        pngs.append(PNG_FILE)
    study = history.read_study(sweep) if plot else None   # an expgpu_optuna sweep's study
    if study is not None and history.plot(study, sweep / history.PNG, f"{sweep}: study {study['study']}"):
        pngs.append(history.PNG)
    written += [sweep / p for p in pngs]
    html.write(rows, ranking, sweep / HTML_FILE, str(sweep), pngs, progress)
    written.append(sweep / HTML_FILE)
    return written
