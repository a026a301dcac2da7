"""`expgpu-report DIR` (and the sweep-end report) on real sweep dirs: the metric it ranks by and why
(the objective, else the rule on the names the jobs returned), the best job first, the overrides
that differ, a column per returned metric, curves, report.html, the one-line reason of a failed
job, and broken or missing job dirs listed, never fatal."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, left_early, write_job

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("test_report")]


def report(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expgpu.report", str(path), *args], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


def sweep_of(sweep: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep}"], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=200)


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory) -> Path:
    """A real two-job sweep with Hydra's basic launcher (jobs one after the other, in-process)."""
    sweep = tmp_path_factory.mktemp("report") / "sweep"
    done = sweep_of(sweep, "task=a,b", "task.max_steps=20", "task.log_every=5")
    assert done.returncode == 0, done.stderr
    # The sweep-end report: written by the sweep itself, the best job named in one line.
    assert (sweep / "report.html").exists() and (sweep / "report.csv").exists()
    assert (f"sweep report: {sweep / 'report.html'} (2 jobs); ranked by final_loss (lower is better; chosen: the "
            "training loss that every finished job returned (eval_loss: only 1 of 2)") in done.stdout + done.stderr
    return sweep


def rows_of(csv_path: Path) -> list[dict]:
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


# -- which metric, without objective= ---------------------------------------------------------

def _rows(*returned: dict, status: tuple[str, ...] = ()) -> list:
    from expgpu.report.collect import Row

    return [Row(job=str(i), dir=None, status=(status[i] if i < len(status) else "finished"), metrics=dict(m),
                overrides=[f"lr={i}"]) for i, m in enumerate(returned)]


@pytest.mark.parametrize("returned,metric,maximize,why", [
    # what tasks return: a held-out metric before the training loss, its kind read from its words
    ([{"train_loss": 0.3, "best_val_loss": 0.5}, {"train_loss": 0.2, "best_val_loss": 0.4}],
     "best_val_loss", False, "a held-out loss that every finished job returned"),
    ([{"loss": 0.3, "val/acc": 0.5}, {"loss": 0.2, "val/acc": 0.7}], "val/acc", True, "a held-out score"),
    ([{"lr": 0.1, "eval.acc": 0.5, "val_loss_best": 0.4}], "eval.acc", True, "a held-out score"),
    ([{"steps_seen": 3, "val_loss_best": 0.4, "train_acc": 0.9}], "val_loss_best", False, "a held-out loss"),
    ([{"final_loss": 1.0, "test_top1": 0.5}], "test_top1", True, "a held-out score"),
    ([{"final_loss": 1.0, "top1_err": 0.5}], "top1_err", False, "a loss"),      # the last word says: an error
    ([{"macro_f1": 0.5, "final_loss": 0.2, "x": 1}], "macro_f1", True, "a score"),   # final_loss: the last resort
    # a metric every finished job returned ranks them all: before one that only some returned
    ([{"final_loss": 1.0, "val_loss": 0.5}, {"final_loss": 0.5}], "final_loss", False,
     "the training loss that every finished job returned (val_loss: only 1 of 2)"),
    ([{"val_loss": 0.5, "val/loss": 0.6}, {"val/loss": 0.4}, {"train_loss": 0.1}], "val/loss", False,
     "a held-out loss that 2 of 3 finished jobs returned, the most"),
])
def test_without_objective_the_rule_picks_a_returned_metric_and_says_why(returned, metric, maximize, why):
    from expgpu.report import rank

    ranking = rank(_rows(*returned))
    assert (ranking.metric, ranking.maximize) == (metric, maximize)
    assert ranking.why.startswith("chosen: ") and why in ranking.why, ranking.why
    assert ranking.why.endswith("; objective= or --metric choose another")
    # a failed job's metrics count for nothing: it ranks no job
    failed = rank(_rows(*returned, {"zzz_loss": 0.0, "val_zzz_loss": 0.0}, status=("finished",) * len(returned)
                        + ("failed",)))
    assert (failed.metric, failed.why) == (ranking.metric, ranking.why)


def test_the_objective_and_metric_by_hand_win_and_a_name_of_no_kind_is_a_stated_guess():
    from expgpu.report import rank
    from expgpu.report.table import headline

    rows = _rows({"best_val_loss": 0.5, "modes_covered": 3}, {"best_val_loss": 0.4, "modes_covered": 7})
    for r in rows:
        r.objective = ["modes_covered"]
    by_objective = rank(rows)
    assert (by_objective.metric, by_objective.maximize, by_objective.best.job) == ("modes_covered", False, "0")
    assert headline(by_objective) == (
        "ranked by modes_covered (lower is better, assumed: the name says neither loss nor score, --maximize if "
        "not; the jobs' objective); best: job 0 (lr=0), modes_covered 3")
    for r in rows:
        r.maximize = [True]   # an optimizing sweeper's direction
    assert rank(rows).maximize is True and "assumed" not in headline(rank(rows))
    by_hand = rank(rows, "best_val_loss")
    assert headline(by_hand) == "ranked by best_val_loss (lower is better; chosen by --metric); best: job 1 (lr=1), " \
                                "best_val_loss 0.4"
    assert rank(rows, "best_val_loss", True).best.job == "0"
    assert headline(rank(_rows({}, {}))) == "nothing to rank by: no finished job returned a number"


def test_the_report_line_names_the_metric_it_chose_and_why(tmp_path):
    """A sweep of a task of one's own that returns best_val_loss: it ranks, says why, and the CSV
    and the page follow (before, it said "no job returned a metric to rank by")."""
    sweep = tmp_path / "sweep"
    for n, best in enumerate([0.5, 0.3, 0.4]):
        write_job(sweep / str(n), ["task=mine", f"task.lr={n}"], {"train_loss": 0.1 * n, "best_val_loss": best},
                  {"loss": [(10, 1.0), (20, 0.5)], "val/loss": [(20, best)]})
    done = report(sweep, "--no-plot")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("ranked by best_val_loss (lower is better; chosen: a held-out loss that every finished job "
                        "returned; objective= or --metric choose another); best: job 1 (task.lr=1), best_val_loss 0.3")
    assert lines[2].split()[3:5] == ["best_val_loss", "train_loss"]
    assert [line.split()[1] for line in lines[3:6]] == ["1", "2", "0"]
    assert [(r["job"], r["rank"], r["best"]) for r in rows_of(sweep / "report.csv")] == [
        ("0", "3", ""), ("1", "1", "yes"), ("2", "2", "")]
    assert "chosen: a held-out loss" in (sweep / "report.html").read_text()


def test_a_finished_job_whose_loss_diverged_is_said_under_the_table(tmp_path):
    sweep = tmp_path / "sweep"
    for n, loss in enumerate([0.3, float("nan")]):
        write_job(sweep / str(n), [f"task.optimizer.lr={10 ** (4 * n - 3)}"], {"final_loss": loss})
    result = json.loads((sweep / "1" / "result.json").read_text())
    (sweep / "1" / "result.json").write_text(json.dumps({**result, "nonfinite": {"loss": 10}}))
    done = report(sweep, "--no-plot")
    assert done.returncode == 0, done.stderr
    said = "job 1: diverged: loss nan or inf from step 10 (it trained on to its end)"
    assert f"  {said}" in done.stdout.splitlines() and "job 0:" not in done.stdout, done.stdout
    assert said.split(": ", 1)[1] in (sweep / "report.html").read_text()
    # task.on_nonfinite=stop: the job's status is diverged, shown with its step, unranked, and said so
    (sweep / "1" / "result.json").write_text(json.dumps({**result, "nonfinite": {"loss": 10}, "status": "diverged",
                                                         "steps": 12, "metrics": {}}))
    done = report(sweep, "--no-plot")
    assert done.returncode == 0, done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.split()[1:2] == ["1"])
    assert row[:3] == ["-", "1", "diverged@12"], done.stdout
    assert "  job 1: diverged: loss nan or inf from step 10 (stopped there: task.on_nonfinite=stop)" \
        in done.stdout.splitlines(), done.stdout


@pytest.mark.slow
def test_one_row_per_job_best_first_csv_html_and_curves(basic_sweep, tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(basic_sweep, sweep)
    for name in ("report.csv", "report.html", "loss_curves.png"):
        (sweep / name).unlink()
    done = report(sweep)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    results = {n: json.loads((sweep / str(n) / "result.json").read_text())["metrics"] for n in (0, 1)}
    # Both jobs return final_loss, only task b eval_loss: final_loss ranks both, and the line says so.
    best = min(results, key=lambda n: results[n]["final_loss"])
    assert lines[0] == ("ranked by final_loss (lower is better; chosen: the training loss that every finished job "
                        "returned (eval_loss: only 1 of 2); objective= or --metric choose another); "
                        f"best: job {best} (task={'ab'[best]}), final_loss {results[best]['final_loss']:.6g}")
    assert lines[1] == "every job: task.max_steps=20 task.log_every=5"
    assert lines[2].split() == ["rank", "job", "status", "final_loss", "eval_loss", "accuracy", "steps", "wall_s",
                                "devices", "overrides"]
    assert lines[3].split()[:3] == ["1*", str(best), "finished"] and lines[3].split()[-1] == f"task={'ab'[best]}"
    assert lines[4].split()[:3] == ["2", str(1 - best), "finished"]

    rows = rows_of(sweep / "report.csv")   # job order, a rank column
    assert [(r["job"], r["task"], r["status"], r["rank"], r["best"]) for r in rows] == [
        ("0", "a", "finished", "2" if best else "1", "" if best else "yes"),
        ("1", "b", "finished", "1" if best else "2", "yes" if best else "")]
    for r, n in zip(rows, (0, 1)):
        result = json.loads((sweep / str(n) / "result.json").read_text())
        assert float(r["final_loss"]) == result["metrics"]["final_loss"]
        assert float(r["wall_s"]) > 0
    assert rows[1]["accuracy"] != "" and rows[0]["accuracy"] == ""   # task b classifies, a regresses

    png = (sweep / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    page = (sweep / "report.html").read_text()
    assert "<tr class='best'>" in page and "<img src='loss_curves.png'" in page and "task=b" in page


@pytest.mark.slow
def test_the_objective_ranks_the_jobs_and_the_curves_show_eval_metrics(tmp_path):
    sweep = tmp_path / "sweep"
    done = sweep_of(sweep, "task=b", "task.max_steps=20", "task.eval_every=10", "task.optimizer.lr=0.001,0.1,0.03",
                    "objective=accuracy")
    assert done.returncode == 0, done.stderr[-3000:]
    results = {n: json.loads((sweep / str(n) / "result.json").read_text())["metrics"] for n in range(3)}
    best = max(results, key=lambda n: results[n]["accuracy"])
    out = report(sweep, "--no-plot").stdout.splitlines()
    assert out[0].startswith(f"ranked by accuracy (higher is better; the jobs' objective); best: job {best} "
                             "(task.optimizer.lr=")
    assert out[1] == "every job: task=b task.max_steps=20 task.eval_every=10 objective=accuracy"
    assert out[2].split()[3:6] == ["accuracy", "final_loss", "eval_loss"]
    order = [line.split()[1] for line in out[3:6]]
    assert order == [str(n) for n in sorted(results, key=lambda n: -results[n]["accuracy"])]
    assert [line.split()[-1] for line in out[3:6]] == [f"task.optimizer.lr={lr}" for lr in
                                                     [("0.001", "0.1", "0.03")[int(n)] for n in order]]
    by_hand = report(sweep, "--no-plot", "--metric", "eval_loss").stdout.splitlines()[0]
    assert by_hand.startswith("ranked by eval_loss (lower is better; chosen by --metric); best: job ")
    unknown = report(sweep, "--metric", "bleu")
    assert unknown.returncode == 2 and unknown.stderr.strip() == (
        "python -m expgpu.report: error: --metric bleu: no job returned it; they returned accuracy, eval_loss, "
        "final_loss")

    from expgpu.report import rank
    from expgpu.report.collect import collect
    from expgpu.report.plot import panels

    rows = collect(sweep)
    # the objective, the training loss, held-out metrics, the rest
    assert panels(rows, rank(rows)) == ["accuracy", "loss", "eval_loss", "lr"]


@pytest.mark.slow
def test_a_failed_job_shows_its_one_line_reason(tmp_path):
    sweep = tmp_path / "sweep"
    done = sweep_of(sweep, "task=a", "task.max_steps=20", "faults.crash_rank=0", "faults.crash_step=5,1000")
    assert done.returncode == 1
    # Hydra skips its multirun-end callbacks when a job fails: the report is written at exit instead.
    assert f"expgpu: sweep report: {sweep / 'report.html'}" in done.stdout
    # The job's one rank trained in its launcher, or was forked by a warm server (conftest.clean_env),
    # and its launcher, which supervised it, names it.
    reason = "RuntimeError: injected crash (faults.crash_rank=0 faults.crash_step=5)"
    if (sweep / "0" / "logs" / "rank0.log").exists():
        reason = f"rank 0 failed: {reason}"
    out = report(sweep, "--no-plot").stdout
    assert f"  job 0: {reason}" in out
    status = {r["job"]: (r["status"], r["error"]) for r in rows_of(sweep / "report.csv")}
    assert status == {"0": ("failed", reason), "1": ("finished", "")}
    assert reason in (sweep / "report.html").read_text()


@pytest.mark.slow
def test_broken_and_missing_job_dirs_are_listed_not_fatal(basic_sweep, tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(basic_sweep, sweep)
    # Job 3 crashed while writing (torn result.json, a bad metrics line); job 2 left nothing at all.
    shutil.copytree(sweep / "1", sweep / "3")
    (sweep / "3" / "result.json").write_text('{"status": "fini')
    with open(sweep / "3" / "metrics.jsonl", "a") as f:
        f.write('{"step": 25, "lo\n')
    # Job 4: a rank failed (expgpu wrote its failure) before any result.
    (sweep / "4" / ".expgpu").mkdir(parents=True)
    (sweep / "4" / ".hydra").mkdir()
    (sweep / "4" / ".expgpu" / "rank1.failure.json").write_text(json.dumps(
        {"rank": 1, "message": "RuntimeError: CUDA out of memory", "user_error": False}))
    done = report(sweep)
    assert done.returncode == 0, done.stderr
    status = {r["job"]: (r["status"], r["error"]) for r in rows_of(sweep / "report.csv")}
    assert status["0"][0] == status["1"][0] == "finished"
    assert status["2"] == ("missing", "no job dir")
    assert status["3"][0] == "broken" and "result.json unreadable" in status["3"][1]
    assert status["4"] == ("failed", "rank 1: RuntimeError: CUDA out of memory")
    assert "job 4: rank 1: RuntimeError: CUDA out of memory" in done.stdout
    assert (sweep / "loss_curves.png").exists()   # the broken job's curve is still drawn


@pytest.mark.slow
def test_at_42_jobs_the_legend_names_the_best_ten_beside_the_plot(basic_sweep, tmp_path):
    """42 copies of a real job dir, each with its own learning rate and final loss."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for n in range(42):
        job = sweep / str(n)
        shutil.copytree(basic_sweep / "0", job)
        (job / ".hydra" / "overrides.yaml").write_text(f"- task=a\n- task.optimizer.lr={n / 1000}\n")
        result = json.loads((job / "result.json").read_text())
        result["metrics"]["final_loss"] = abs(n - 20) + 0.5   # job 20 best, then 19 and 21, ...
        (job / "result.json").write_text(json.dumps(result))
    from expgpu.report import rank
    from expgpu.report.collect import collect
    from expgpu.report.plot import plot

    rows = collect(sweep)
    ranking = rank(rows)
    assert ranking.metric == "final_loss" and ranking.best.job == "20"
    labels = plot(rows, ranking, sweep / "loss_curves.png", "42 jobs")
    assert len(labels) == 10 and labels[0] == "#20 task.optimizer.lr=0.02"
    assert {lbl.split()[0] for lbl in labels} == {f"#{n}" for n in (20, 19, 21, 18, 22, 17, 23, 16, 24, 15)}
    import matplotlib.image

    assert matplotlib.image.imread(sweep / "loss_curves.png").shape[1] > 1000   # room for the legend beside it
    done = report(sweep)
    assert done.returncode == 0 and done.stdout.splitlines()[0] == (
        "ranked by final_loss (lower is better; chosen: the training loss that every finished job returned; "
        "objective= or --metric choose another); best: job 20 (task.optimizer.lr=0.02), final_loss 0.5")


@pytest.mark.slow
def test_a_single_run_dir_and_bad_arguments(basic_sweep, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(basic_sweep / "0", run)
    done = report(run, "--no-plot")
    assert done.returncode == 0, done.stderr
    assert [r["status"] for r in rows_of(run / "report.csv")] == ["finished"]
    assert not (run / "loss_curves.png").exists()

    missing = report(tmp_path / "nope")
    assert missing.returncode == 2
    assert missing.stderr.strip() == (f"python -m expgpu.report: error: {tmp_path / 'nope'}: no such directory; "
                                      "give a sweep dir such as outputs/multirun/DATE/TIME")
    (tmp_path / "empty").mkdir()
    empty = report(tmp_path / "empty")
    assert empty.returncode == 2 and "no job dirs in it" in empty.stderr and "Traceback" not in empty.stderr
    script = Path(sys.executable).parent / "expgpu-report"   # the console script runs the same
    same = subprocess.run([str(script), str(run), "--no-plot"], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert same.returncode == 0 and same.stdout == done.stdout
    # `expgpu report DIR`, a command of expgpu's beside `expgpu status`, as the console script calls it
    command = subprocess.run([sys.executable, "-c", "import sys; from expgpu.__main__ import main; "
                              "sys.argv[0] = 'expgpu'; main()", "report", str(run), "--no-plot"], cwd=REPO,
                             env=clean_env(), capture_output=True, text=True, timeout=120)
    assert command.returncode == 0 and command.stdout == done.stdout, command.stderr
    wrong = subprocess.run(command.args[:4] + [str(tmp_path / "nope")], cwd=REPO, env=clean_env(),
                           capture_output=True, text=True, timeout=120)   # its errors name the command typed
    assert wrong.returncode == 2 and wrong.stderr.startswith("expgpu report: error: "), wrong.stderr


def test_a_reader_that_leaves_early_gets_no_traceback_and_the_files_are_written(tmp_path):
    """`expgpu-report DIR | head -1`: the table is longer than a pipe holds (64 KiB)."""
    for i in range(600):
        write_job(tmp_path / str(i), [f"task.seed={i}", "task=a"], {"final_loss": 1.0 / (i + 1)})
    done = left_early([sys.executable, "-m", "expgpu.report", str(tmp_path), "--no-plot"], timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ranked by final_loss") and done.stderr == "", \
        done.stderr[-2000:]
    assert len(rows_of(tmp_path / "report.csv")) == 600   # written after the table, all the same
