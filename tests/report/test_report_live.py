"""report.html while a sweep runs (expgpu.report.live), on real sweeps in real processes: written at the
start with the planned jobs, rewritten as jobs end (a finished job listed while a slow one still runs),
never torn, and a final page without the reload; read by a real headless browser (Debian's chromium), which
runs the page's script: the running page shows its age, and one left by a killed sweep says it is stale.

Without chromium the browser checks skip (EXPGPU_REQUIRE_BROWSER=1, as .ci/run sets it once it installed
chromium, makes them fail instead)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HELPERS, PACED, REPO, clean_env

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("test_report")]

SIM2 = "inventory.simulate=[{name:A100,memory_mb:40960},{name:A100,memory_mb:40960}]"
LIVE = "hydra.callbacks.report.refresh_s=0.5"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        why = "no chromium on PATH (Debian: apt-get install chromium)"
        if os.environ.get("EXPGPU_REQUIRE_BROWSER") == "1":
            pytest.fail(f"EXPGPU_REQUIRE_BROWSER=1 but {why}", pytrace=False)
        pytest.skip(why)
    return found


def dom(page: Path) -> str:
    """The page's DOM after a real browser loaded it and ran its script."""
    done = subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                           page.resolve().as_uri()], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    return done.stdout


def state_line(html: str) -> str:
    """The text of the page's #sweep-state paragraph (its markup dropped)."""
    m = re.search(r"<p id=.sweep-state.(.*?)</p>", html, re.S)
    assert m, html[:2000]
    return re.sub(r"<[^>]+>", "", m.group(0))


def row_status(html: str, job: str) -> str:
    m = re.search(rf"<tr class=.[\w-]+.><td class=.num.>[^<]*</td><td>(?:<a [^>]*>)?{job}(?:</a>)?</td>"
                  r"<td>([^<]*)</td>", html)
    assert m, html[:3000]
    return m.group(1)


class Watched:
    """A sweep started in its own process, its report.html read every 50 ms while it runs."""

    def __init__(self, sweep: Path, args: list[str], env: dict | None = None):
        self.sweep, self.page = sweep, sweep / "report.html"
        self.proc = subprocess.Popen([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep}", LIVE],
                                     cwd=REPO, env=env or clean_env(), text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.pages: list[str] = []   # every distinct page seen, in order

    def until(self, cond, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.page.read_text() if self.page.exists() else ""
            if text and (not self.pages or self.pages[-1] != text):
                assert text.endswith("</html>\n"), "a torn page: " + text[-200:]
                self.pages.append(text)
            if text and cond(text):
                return text
            assert self.proc.poll() is None or cond(text), f"the sweep ended first: {self.proc.stderr.read()[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"not seen in {timeout}s; last page: {state_line(self.pages[-1]) if self.pages else None}")

    def wait(self, timeout: float = 180) -> None:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err[-3000:]


def _final_page_checks(sweep: Path, jobs: int) -> None:
    final = (sweep / "report.html").read_text()
    assert "http-equiv" not in final and "<script>" not in final   # the last page stays put
    assert state_line(final).startswith(f"Sweep finished: {jobs} of {jobs} jobs done. Last written ")
    assert (sweep / "loss_curves.png").exists()                    # the curves: at the end
    shown = dom(sweep / "report.html")
    assert 'http-equiv="refresh"' not in shown and "finished" in state_line(shown)


@pytest.mark.slow
def test_a_gpu_pool_sweep_page_lists_a_finished_job_while_another_runs_then_the_final(tmp_path):
    sweep = tmp_path / "sweep"
    # job 1 runs ~16 s: under load a page write may take a few hundred ms, and the next waits 20x that (DUTY)
    w = Watched(sweep, ["hydra/launcher=gpu_pool", SIM2, "task=a", PACED, "task.max_steps=20,2500",
                        "task.log_every=20"])
    first = w.until(lambda t: True)   # the first page: the planned jobs, before any ended
    assert re.search(r"Sweep running: 0 of 2 jobs done \(\d running(, \d queued)?|2 queued\)", state_line(first))
    live = w.until(lambda t: "1 of 2 jobs done (1 running)" in t)
    assert row_status(live, "0") == "finished" and row_status(live, "1") == "running"
    assert "<meta http-equiv='refresh' content='2'>" in live
    kept = tmp_path / "live.html"
    kept.write_text(live)
    w.wait()
    _final_page_checks(sweep, 2)

    shown = dom(kept)   # the running page as a browser shows it: its reload, when written, its age
    assert re.search(r'<meta http-equiv="refresh" content="2">', shown)
    line = state_line(shown)
    assert "Sweep running: 1 of 2 jobs done (1 running). Last written " in line
    assert re.search(r"\(\d+ s ago\)", line), line   # the script ran: the page's age
    assert (sweep / "report.csv").exists()


@pytest.mark.slow
def test_a_basic_launcher_sweep_killed_outright_leaves_a_running_page_a_browser_calls_stale(tmp_path):
    sweep = tmp_path / "sweep"
    w = Watched(sweep, ["task=a", PACED, "task.max_steps=20,5000", "task.log_every=20"])
    live = w.until(lambda t: "1 of 2 jobs done (1 running)" in t)
    assert row_status(live, "0") == "finished" and row_status(live, "1") == "running"
    w.proc.send_signal(signal.SIGKILL)   # no atexit, no last write: the page stays as it was
    w.proc.communicate(timeout=30)
    left = (sweep / "report.html").read_text()
    assert "Sweep running: 1 of 2 jobs done (1 running)" in state_line(left)
    assert "STALE" not in state_line(dom(sweep / "report.html"))   # just written: not stale yet
    # An hour later: a running sweep rewrites its page every minute at least, so this one's is gone.
    written = float(re.search(r"data-written='([\d.]+)'", left).group(1))
    (tmp_path / "later.html").write_text(left.replace(f"data-written='{written:.3f}'",
                                                      f"data-written='{written - 3600:.3f}'"))
    line = state_line(dom(tmp_path / "later.html"))
    assert "STALE: not rewritten for 60 min" in line and "its process may be gone" in line, line


@pytest.mark.slow
def test_an_optimizing_sweep_page_counts_trials_as_they_end(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["--config-dir", str(REPO / "tests" / "conf"), "task=tune_probe", "objective=score",
            "hydra/sweeper=expgpu_optuna", "hydra.sweeper.sampler.seed=0", "task.x=interval(0,1)",
            "hydra.sweeper.n_trials=3", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2",
            "task.max_steps=45", "task.slow_step_s=0.4", "task.step_s=0.01"]
    # trial 0 runs ~18 s: a page write at the sweep's start, when the machine is busiest, may take ~1 s under
    # load, and the next waits 20x that (DUTY)
    w = Watched(sweep, args, clean_env(PYTHONPATH=str(HELPERS)))
    w.until(lambda t: w.proc.poll() is not None, timeout=150)   # every page, to the sweep's end
    w.wait()
    seen = [state_line(p) for p in w.pages]
    # While the slow trial 0 ran, one or both of the others had ended (however busy the machine)
    live = [p for p in w.pages if re.search(r"Sweep running: [12] of 3 jobs done \(1 running", p)]
    assert live and row_status(live[-1], "0") == "running", seen
    final = (sweep / "report.html").read_text()
    assert "http-equiv" not in final
    assert state_line(final).startswith("Sweep finished: 3 of 3 jobs done.")
