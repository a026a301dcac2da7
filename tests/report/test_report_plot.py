"""loss_curves.png: a panel per metric the jobs logged (names with `/`, a task's own), the ranking
metric first, at most MAX_PANELS; on a real sweep, the legend, drawn in the first panel only,
names the jobs by colour, so a job must have the same colour in every panel."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, clean_env, write_job

# What a task of one's own logs, in the order it first logs them.
LOGGED = ["loss", "lr", "val/loss", "val/acc", "grad_norm", "train/acc", "eval.f1", "test_top1", "kl_term",
          "reward_mean", "my_metric", "entropy", "val_perplexity", "tokens_per_s"]


def _sweep_of_own_names(sweep, jobs: int = 3):
    for n in range(jobs):
        series = {name: [(s, (1 + n + i) / s) for s in (10, 20, 30)] for i, name in enumerate(LOGGED)}
        write_job(sweep / str(n), ["task=mine", f"task.lr={n}"], {"best_val_loss": 1.0 + n, "train_loss": 0.5}, series)


def _drawn(monkeypatch, sweep, png):
    """plot()'s figure, kept to read: its panels' titles and its texts."""
    import matplotlib.pyplot as plt

    from expgpu.report import rank
    from expgpu.report.collect import collect
    from expgpu.report.plot import plot

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    rows = collect(sweep)
    plot(rows, rank(rows), png, "sweep")
    [fig] = figures
    return fig


def test_every_logged_metric_gets_a_panel_the_ranking_metric_first_capped(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    _sweep_of_own_names(sweep)
    fig = _drawn(monkeypatch, sweep, tmp_path / "curves.png")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    # best_val_loss ranks (not logged): val/loss, the series it was taken from, first; then the
    # training loss; the held-out metrics; the other losses and scores; the rest, in logged order
    assert titles == ["val/loss  (lower is better)", "loss", "val/acc", "eval.f1", "test_top1", "val_perplexity",
                      "train/acc", "reward_mean", "lr", "grad_norm", "kl_term", "my_metric"]
    assert "not drawn (12 panels at most): entropy, tokens_per_s" in [t.get_text() for t in fig.texts]
    assert [ax.get_yscale() for ax in fig.axes[:2]] == ["log", "log"]   # losses, all positive
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 12 and fig.axes[0].get_subplotspec().get_gridspec() \
        .get_geometry() == (4, 3)
    import matplotlib.image

    height, width = matplotlib.image.imread(tmp_path / "curves.png").shape[:2]
    assert 1200 < width < 2000 and 1200 < height < 2000   # 3 columns of 12 panels: a screenful, not a poster


def test_few_metrics_are_all_drawn_ranking_first_with_no_note(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    for n in range(2):
        write_job(sweep / str(n), [f"task.lr={n}"], {"eval/acc": 0.5 + n / 10},
                  {"loss": [(10, 1.0), (20, 0.5)], "eval/acc": [(20, 0.5 + n / 10)], "lr": [(10, 0.1), (20, 0.1)]})
    fig = _drawn(monkeypatch, sweep, tmp_path / "curves.png")
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == [
        "eval/acc  (higher is better)", "loss", "lr"]
    assert not [t for t in fig.texts if "not drawn" in t.get_text()]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["#1 task.lr=1", "#0 task.lr=0"]   # best first


@pytest.mark.slow
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

    from expgpu.report import rank
    from expgpu.report.collect import collect
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


def test_matplotlibs_own_info_lines_stay_out_of_the_sweeps_log(tmp_path):
    # Hydra logs at INFO to the console; matplotlib's first use on a machine (no font cache yet) says
    # "generated new fontManager" at INFO, which read as a line of the sweep's own
    code = "import logging; logging.basicConfig(level=logging.INFO); {}"
    env = {**clean_env(), "MPLCONFIGDIR": str(tmp_path / "plain")}   # a first use: the cache is built
    plain = subprocess.run([sys.executable, "-c", code.format("import matplotlib.pyplot")], env=env,
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "generated new fontManager" in plain.stderr, plain.stderr
    env["MPLCONFIGDIR"] = str(tmp_path / "ours")
    ours = subprocess.run([sys.executable, "-c", code.format("from expgpu.report.plot import pyplot; pyplot()")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert ours.returncode == 0 and "matplotlib" not in ours.stderr and not ours.stderr.strip(), ours.stderr
