"""loss_curves.png on a real sweep: one panel per metric, and the legend, drawn in the first panel
only, names the jobs by colour; so a job must have the same colour in every panel."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, clean_env


def test_a_job_has_the_same_colour_in_every_panel(tmp_path, monkeypatch):
    # Task a logs loss only, task b also eval_loss and accuracy: the eval panels hold job 1 alone,
    # which matplotlib's colour cycle drew in the colour the loss panel (and its legend) gives job 0.
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", "task=a,b", "task.max_steps=20", "task.log_every=5",
                           f"hydra.sweep.dir={sweep}"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    import matplotlib.colors
    import matplotlib.pyplot as plt

    from expgpu.report import collect, rank
    from expgpu.report.plot import plot

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))   # keep it to read it
    rows = collect(sweep)
    plot(rows, rank(rows), tmp_path / "curves.png", "sweep")
    [fig] = figures
    colours: dict[str, set[str]] = {}
    for ax in fig.axes:
        name = ax.get_title().split()[0] if ax.get_title() else None
        for line in ax.get_lines():
            [job] = [r.job for r in rows if [v for _, v in r.series.get(name, [])] == list(line.get_ydata())]
            colours.setdefault(job, set()).add(matplotlib.colors.to_hex(line.get_color()))
    assert set(colours) == {"0", "1"} and all(len(c) == 1 for c in colours.values()), colours
    assert colours["0"] != colours["1"]
