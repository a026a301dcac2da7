"""A run's progress (expgpu.loggers.progress): its pace and time left on a clock of the test's own, the line
it shows; then real runs: the built-in loop's log lines and rows, run.epochs' epochs and length, and a
script's rows shown by its supervisor."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, expgpu
from expgpu.loggers import progress
from expgpu.loggers.progress import Pace, line


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "monotonic", c.monotonic)
    return c


def test_the_pace_is_steps_per_second_lately_and_the_time_left_at_it(clock):
    pace = Pace(0, max_steps=200)
    clock.now += 10
    assert pace.fields(50) == {"max_steps": 200, "steps_per_s": 5.0, "eta_s": 30.0}
    clock.now += 40                              # slower: 1 step/s, and the window (30 s) forgets the start
    assert pace.fields(90)["steps_per_s"] == 1.0
    clock.now += 40
    assert pace.fields(130) == {"max_steps": 200, "steps_per_s": 1.0, "eta_s": 70.0}
    assert pace.fields(120) == {"max_steps": 200}   # a row behind the last (an evaluation's step): no pace
    # from a resumed step, without a length: the pace alone; run.epochs' count once planned
    resumed = Pace(1000, epochs=3)
    clock.now += 2
    assert resumed.fields(1010) == {"epochs": 3, "steps_per_s": 5.0}


def test_the_pace_holds_the_share_of_its_window_spent_waiting_for_batches(clock):
    pace = Pace(0, max_steps=100)
    clock.now += 10
    assert pace.fields(50, waited=4.0)["data_wait"] == 0.4
    clock.now += 40                              # the window (30 s) forgets the start: 20 s of the last 40
    assert pace.fields(90, waited=24.0)["data_wait"] == 0.5
    clock.now += 10
    assert "data_wait" not in pace.fields(95)   # a loop that takes no batches from a loader


def test_the_line_says_the_step_of_how_many_the_epoch_the_values_the_pace_and_the_time_left():
    fields = {"max_steps": 200, "steps_per_s": 12.3, "eta_s": 11.2}
    assert line(60, {"loss": 0.04041234}, fields) == "step 60/200 (30 %)  loss 0.040412  12.3 steps/s  ETA 0:00:11"
    assert line(60, {"loss": 0.5}, {**fields, "epochs": 5}, epoch=3, first_epoch=1) == \
        "step 60/200 (30 %)  epoch 3/5  loss 0.5  12.3 steps/s  ETA 0:00:11"
    assert line(7, {"loss": 1.0}, {"steps_per_s": 0.25}) == "step 7  loss 1  0.25 steps/s"   # no length known
    assert line(7, {}, {"max_steps": 10, "eta_s": 7384.0}) == "step 7/10 (70 %)  ETA 2:03:04"
    assert line(7, {}, {"steps_per_s": 1286.4}) == "step 7  1286 steps/s"   # a fast loop: no 1.29e+03
    assert line(7, {}, {"steps_per_s": 9.5, "data_wait": 0.352}) == "step 7  9.5 steps/s  data 35%"
    assert line(7, {}, {"steps_per_s": 9.5, "data_wait": 0.04}) == "step 7  9.5 steps/s"   # a loader that keeps up
    # on a terminal, rich's bar shows the step, the share and the time left itself
    assert line(60, {"loss": 0.5}, fields, bar=True) == "loss 0.5  12.3 steps/s"


def test_the_display_shows_a_line_every_5_s_the_bar_every_tenth_and_both_end_on_the_last_row(clock, caplog):
    caplog.set_level("INFO", logger="expgpu")
    shown = progress.Display(100, 0, live=True)
    bar = shown.bar.tasks[0]
    for step in range(1, 101):          # a row every 10 ms: 1 s in all
        clock.now += 0.01
        shown.update(step, {"loss": 1.0 / step}, {"max_steps": 100})
        if step == 20:
            assert bar.completed == 11   # drawn at step 1, then 0.1 s later; step 20 not yet
    assert [r.getMessage() for r in caplog.records] == ["step 1/100 (1 %)  loss 1"]
    shown.close()   # the last row: on the bar and in a line, though neither was due
    assert bar.completed == 100 and bar.description == "loss 0.01"
    assert [r.getMessage() for r in caplog.records][-1] == "step 100/100 (100 %)  loss 0.01"


@pytest.mark.slow
def test_the_built_in_loop_says_its_step_of_how_many_its_pace_and_eta_in_its_lines_and_rows(tmp_path):
    run = expgpu(["task=a", "task.max_steps=120", "task.log_every=1"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.output.splitlines() if " - step " in ln]
    data = r"(  data \d+%)?"   # the share of the time spent fetching batches, from 5 %
    first = rf" - step 1/120 \(1 %\)  loss \S+  lr 0\.001  [\d.]+ steps/s{data}  ETA \d:\d\d:\d\d$"
    assert re.search(first, lines[0]), lines
    assert re.search(rf" - step 120/120 \(100 %\)  loss .* steps/s{data}  ETA 0:00:00$", lines[-1]), lines
    rows = run.metrics()
    assert all(r["max_steps"] == 120 and r["steps_per_s"] > 0 and r["eta_s"] >= 0 for r in rows)
    assert rows[-1]["eta_s"] == 0.0
    assert "steps_per_s" not in run.result["metrics"]   # the pace is no metric of the task's


@pytest.mark.slow
def test_run_epochs_rows_hold_the_epoch_count_and_the_length_from_the_loaders_batches(tmp_path):
    run = expgpu(["--config-dir", str(REPO / "tests" / "conf"), "task=probe_rnnlm_locals", "task.epochs=3",
                  "task.log_every=1"], tmp_path / "run", env=clean_env(PYTHONPATH=str(REPO / "tests" / "helpers")))
    assert run.returncode == 0, run.stderr
    rows = run.metrics()
    assert {(r["max_steps"], r["epochs"]) for r in rows} == {(48, 3)}   # 16 batches an epoch
    assert [r["epoch"] for r in rows][::16] == [1, 2, 3]
    assert re.search(r" - step 48/48 \(100 %\)  epoch 3/3  loss ", run.output), run.output[-2000:]


@pytest.mark.slow
def test_a_scripts_rows_are_shown_by_its_supervisor_with_the_length_it_gave(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import time\nimport expgpu\n"
                      "for it in range(1, 31):\n"
                      "    time.sleep(0.01)\n"
                      "    expgpu.log(loss=1.0 / it, step=it, max_steps=30)\n")
    run = expgpu(["--config-dir", str(REPO / "tests" / "conf"), "task=script_probe", f"task.script={script}",
                  "task.args=null"], tmp_path / "run", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert re.search(r"\[expgpu\]\[INFO\] - step \d+/30 \(\d+ %\)  loss \S+  [\d.]+ steps/s  ETA ", run.output), \
        run.output
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["step"], last["max_steps"], last["eta_s"]) == (30, 30, 0.0)
    assert "max_steps" not in run.result["metrics"] and run.result["metrics"]["loss"] == pytest.approx(1 / 30)


@pytest.mark.slow
def test_on_a_terminal_a_live_bar_and_the_log_file_keeps_the_plain_lines(tmp_path):
    main, child = pty.openpty()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "expgpu", "task=a", "task.max_steps=300", "task.log_every=1",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, env=clean_env(), stdin=child, stdout=child,
                            stderr=child)
    os.close(child)
    seen = b""
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:   # the terminal's other end closed: the run is over
            break
        if not data:
            break
        seen += data
    assert proc.wait(timeout=120) == 0, seen[-3000:]
    console = seen.decode(errors="replace")
    assert "steps/s" in console and "━" in console, console[-2000:]          # rich's bar, with the pace
    assert not re.search(r"\] - step \d+/300", console), console[-2000:]      # no progress log line there
    kept = (run_dir / "expgpu.log").read_text()
    assert re.search(r"\] - step 1/300 \(0 %\)  loss ", kept) and "step 300/300 (100 %)" in kept, kept
