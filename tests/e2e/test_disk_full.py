"""A run dir whose disk fills up (a real tmpfs of 400 KiB, room for one checkpoint of task a, not for its next
one beside it): the run fails in one line naming the file it could not write, without a traceback, on one rank
and on two, and the checkpoint written before stays whole (write, fsync, rename)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import clean_env, expgpu

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.parametrize("nproc, warm", [(1, False), (1, True), (2, True)])
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(small_disk, nproc, warm):
    run_dir = small_disk / "run"
    env = clean_env() if warm else clean_env(EXPGPU_WARM_SERVER="")   # without: one rank trains in the process
    run = expgpu(["task=a", "task.max_steps=300", "checkpoint.every_steps=50", f"launch.nproc_per_node={nproc}"],
                 run_dir, env=env)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    # the rank's own line, or its supervisor's (a rank forked by a warm server, several ranks) naming it
    assert last.startswith(("expgpu: error: could not write", "expgpu: rank 0 failed: could not write")), last
    assert last.endswith(f"could not write {run_dir}/checkpoint.pt: No space left on device; what was written before "
                         "it (the last checkpoint) is kept: make room there, or give the run another hydra.run.dir, "
                         "and rerun to resume"), last
    kept = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert kept["step"] == 50
    assert not [p.name for p in run_dir.iterdir() if ".tmp" in p.name], "a partial file was left behind"
