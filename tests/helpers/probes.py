"""Running a probe task (helpers/run_probe.py and its friends, named by tests/conf/task/probe_*.yaml)
through the real CLI, and reading the one line a refused run prints."""

from __future__ import annotations

from pathlib import Path

from conftest import HELPERS, TESTS, Run, clean_env, expgpu

PROBE_ENV = clean_env(PYTHONPATH=str(HELPERS))


def probe(args: list[str], run_dir: Path, env: dict | None = None, **kw) -> Run:
    return expgpu(["--config-dir", str(TESTS / "conf"), *args], run_dir, env=env or PROBE_ENV, **kw)


def error_line(run: Run) -> str:
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: error: "), run.stderr[-3000:]
    return last
