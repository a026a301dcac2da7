"""A stop lands in time, on every rank at the same step, whoever sends the signal: 2 ranks of a
real `python -m expgpu launch.nproc_per_node=2` run whose steps take a second, and the signal sent
to the launcher's pid alone (`kill`, a tool, a scheduler), not to its process group."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from probes import PROBE_ENV

from conftest import TESTS, finish, start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _at(run_dir: Path) -> int:
    try:
        return int((run_dir / "at").read_text() or -1)
    except (OSError, ValueError):
        return -1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_every_rank_within_two_slow_steps(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = start(["--config-dir", str(TESTS / "conf"), "task=probe_paced", "task.step_s=1.0", "task.max_steps=12",
                  "launch.nproc_per_node=2"], run_dir, env=PROBE_ENV)
    deadline = time.monotonic() + 90
    while _at(run_dir) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _at(run_dir) == 2, f"the run did not reach step 2: {proc.poll()}"
    proc.send_signal(sig)   # the launcher's pid only: its workers hear of it from it
    run = finish(proc, run_dir)
    assert run.returncode == 128 + sig, (run.returncode, run.stderr[-3000:])
    res = run.result
    assert res["status"] == "stopped" and res["stop_signal"] == sig.name, res
    # Signalled during step 2 (the third): saved at the end of it, or at the latest of the next.
    assert 3 <= res["steps"] <= 4, res["steps"]
    assert res["rank_checksums"][0] == res["rank_checksums"][1]
