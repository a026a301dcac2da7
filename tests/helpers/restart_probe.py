"""hang_probe.hangs, hanging only in the run's first attempt (`--config-dir tests/conf task=probe_hangs_once`):
rank `rank` leaves a marker in the run dir when it starts, and a later attempt (launch.on_hang=restart) that
finds it trains on past step `at` (tests/launch/test_restarts.py)."""

from __future__ import annotations

from hang_probe import hangs

from expgpu import Run


def hangs_once(run: Run, rank: int = 1, at: int = 5, how: str = "sleep", max_steps: int = 20,
               step_s: float = 0.0):
    marker = run.run_dir / "hung-once"
    if run.rank == rank:
        if marker.exists():
            at = -1   # never
        else:
            marker.touch()
    return hangs(run, rank=rank, at=at, how=how, max_steps=max_steps, step_s=step_s)
