"""The live report's parts in this process, no sweep started: the jobs a sweep plans (Hydra's own expansion),
what a page says about a running sweep and an ended one, and the writer thread on a sweep dir written by hand
(rewritten when a job ends, never after it is stopped)."""

from __future__ import annotations

import re
import time

from omegaconf import OmegaConf

from conftest import write_job
from expgpu.report import html, live
from expgpu.report.best import rank
from expgpu.report.collect import Row
from expgpu.report.plan import planned
from expgpu.report.state import over, progress, settle

BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def _cfg(task: list[str], sweeper: dict, subdir: str = "${hydra.job.num}"):
    return OmegaConf.create({"hydra": {"sweeper": sweeper, "overrides": {"task": task},
                                       "sweep": {"dir": "out", "subdir": subdir}}})


def test_the_plan_is_hydras_expansion_params_first_or_a_count():
    cfg = _cfg(["task=a,b", "lr=1"], {"_target_": BASIC, "params": {"seed": "1,2"}})
    assert planned(cfg) == [["seed=1", "task=a", "lr=1"], ["seed=1", "task=b", "lr=1"],
                            ["seed=2", "task=a", "lr=1"], ["seed=2", "task=b", "lr=1"]]
    # A subdir of its own: job i is not dir i, so the page only counts
    assert planned(_cfg(["task=a,b"], {"_target_": BASIC, "params": None}, "${task}")) == 2
    assert planned(_cfg([], {"_target_": "x.ExpgpuOptunaSweeper", "n_trials": 7})) == 7
    assert planned(_cfg([], {"_target_": "x.Other"})) is None


def test_while_running_a_dir_without_a_result_runs_and_a_planned_job_without_a_dir_is_queued(tmp_path):
    write_job(tmp_path / "0", ["task=a"], {"final_loss": 0.1})
    (tmp_path / "1" / ".hydra").mkdir(parents=True)
    rows = [Row(job="0", dir=tmp_path / "0", status="finished"), Row(job="1", dir=tmp_path / "1", status="no result")]
    plan = [["task=a"], ["task=b"], ["task=c"]]
    shown = settle(rows, plan, running=True)
    assert [(r.job, r.status) for r in shown] == [("0", "finished"), ("1", "running"), ("2", "queued")]
    p = progress(shown, plan, "running", 0.0, 2, 180)
    assert (p.done, p.total, p.running, p.queued) == (1, 3, 1, 1)
    ended = settle(rows, plan, running=False)
    assert [r.status for r in ended] == ["finished", "no result", "not_started"]
    assert over(ended, finished=False) == "stopped" and over(ended, finished=True) == "finished"
    # An optimizing sweep: trials not asked for yet count as queued
    p = progress(shown[:2], 5, "running", 0.0, 2, 180)
    assert (p.done, p.total, p.running, p.queued) == (1, 5, 1, 3)


def test_a_running_page_reloads_and_says_when_written_an_ended_one_does_neither(tmp_path):
    rows = [Row(job="0", dir=None, status="finished", metrics={"final_loss": 0.5}),
            Row(job="1", dir=None, status="running")]
    running = html.page(rows, rank(rows), "t", [], tmp_path, progress(rows, None, "running", time.time(), 5, 180))
    assert "<meta http-equiv='refresh' content='5'>" in running and "<script>" in running
    assert re.search(r"Sweep running: 1 of 2 jobs done \(1 running\)\. Last written \d{4}-", running)
    done = html.page(rows, rank(rows), "t", [], tmp_path, progress(rows, None, "failed", time.time()))
    assert "http-equiv" not in done and "<script>" not in done
    assert re.search(r"Sweep failed: 1 of 2 jobs done\. Last written .* \(final\)", done)
    assert "id='sweep-state'" not in html.page(rows, rank(rows), "t", [], tmp_path)   # expgpu-report: as before


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_the_writer_rewrites_when_a_job_ends_and_never_after_it_stops(tmp_path):
    sweep = tmp_path / "sweep"
    page = sweep / "report.html"
    writer = live.LiveReport(sweep, [["x=1"], ["x=2"]], refresh_s=0.2)
    writer.start()
    try:
        time.sleep(0.3)
        assert not page.exists()   # no sweep dir yet (the sweeper makes it): nothing written, none made
        sweep.mkdir()
        _wait(page.exists)
        assert "Sweep running: 0 of 2 jobs done (2 queued)" in page.read_text()
        write_job(sweep / "0", ["x=1"], {"final_loss": 0.1})
        _wait(lambda: "1 of 2 jobs done (1 queued)" in page.read_text())
        assert (sweep / "report.csv").exists() and not (sweep / "loss_curves.png").exists()
    finally:
        writer.stop()
    before = page.stat().st_mtime_ns
    write_job(sweep / "1", ["x=2"], {"final_loss": 0.2})
    time.sleep(0.6)
    assert page.stat().st_mtime_ns == before


def test_a_jobs_devices_show_each_ranks_gpu_with_its_peak_memory():
    from expgpu.app import gpu_peak
    from expgpu.report.collect import devices

    plan = [{"device": "cuda:0", "gpus": [2], "gpu_peak_reserved_mb": 12595, "gpu_peak_allocated_mb": 10000},
            {"device": "cuda:0", "gpus": [3], "gpu_peak_reserved_mb": 9000, "gpu_peak_allocated_mb": 8000}]
    assert devices({"plan": plan}, simulated=False) == "GPU 2 (12.3 GiB peak); GPU 3 (8.8 GiB peak)"
    assert gpu_peak(plan) == "; GPU memory peak 12.3 GiB"          # the run's last line: the most of any rank
    cpu = [{"device": "cpu", "gpus": []}, {"device": "cpu", "gpus": []}]
    assert devices({"plan": cpu}, simulated=False) == "cpu" and gpu_peak(cpu) == ""
