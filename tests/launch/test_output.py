"""What the ranks print reaches the console a whole line at a time, as it is printed: through a pipe or a
file (an sbatch job's output, `| tee`), where Python would hold a rank's prints to its end, and under
PYTHONUNBUFFERED=1, where the ranks' lines would cut into each other. Function tasks and script tasks."""

from __future__ import annotations

import re
import selectors
import subprocess
import sys
import time

import pytest
from probes import PROBE_ENV

from conftest import HELPERS, REPO, TESTS, clean_env, expgpu

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WHOLE = re.compile(r"^rank [01] line (\d+) x{40}$")


@pytest.mark.parametrize("task", ["probe_chatty", "script_chatty"])
def test_two_ranks_printing_at_once_print_whole_lines(tmp_path, task):
    # PYTHONUNBUFFERED=1 (clean_env's, and a usual line of job scripts): print() writes a line's text and its
    # newline apart. Seen before the fix: ~20 of the 600 lines cut into another rank's.
    run = expgpu(["--config-dir", str(TESTS / "conf"), f"task={task}", "launch.nproc_per_node=2"], tmp_path / "run",
                 env=PROBE_ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    ours = [line for line in run.stdout.splitlines() if "x" * 40 in line]
    cut = [line for line in ours if not WHOLE.match(line)]
    assert not cut and len(ours) == 600, (len(ours), cut[:5])


def test_a_ranks_prints_reach_a_pipe_while_it_runs(tmp_path):
    """Without PYTHONUNBUFFERED the ranks' stdout is a pipe, which Python fills in 8 KiB blocks: each rank
    prints `ready N` and waits until the test, having read both lines, writes `go`."""
    env = {k: v for k, v in clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_SERVER="").items()
           if k != "PYTHONUNBUFFERED"}
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "expgpu", "--config-dir", str(TESTS / "conf"),
                             "task=probe_waits_for_go", "launch.nproc_per_node=2", f"hydra.run.dir={run_dir}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen, deadline = b"", time.monotonic() + 60
    while not (b"ready 0\n" in seen and b"ready 1\n" in seen) and time.monotonic() < deadline and \
            proc.poll() is None:
        if sel.select(0.1):
            seen += proc.stdout.read1(1 << 16)
    (run_dir / "go").write_text("")
    proc.communicate(timeout=60)
    assert b"ready 0\n" in seen and b"ready 1\n" in seen, seen[-2000:]
    assert proc.returncode == 0


def test_launch_stdout_rank0_keeps_a_script_tasks_other_ranks_off_the_console(tmp_path):
    run = expgpu(["--config-dir", str(TESTS / "conf"), "task=script_chatty", "launch.nproc_per_node=2",
                  "launch.stdout=rank0"], tmp_path / "run", env=PROBE_ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    ours = [line for line in run.stdout.splitlines() if "x" * 40 in line]
    assert len(ours) == 300 and all(line.startswith("rank 0 line ") for line in ours), ours[:3]
    kept = (tmp_path / "run" / "logs" / "rank1.script.log").read_text().splitlines()
    assert sum(line.startswith("rank 1 line ") for line in kept) == 300   # its log keeps all of it
