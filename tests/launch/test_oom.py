"""A rank the kernel's OOM killer ends is said so: a real OOM kill, in a memory cgroup of the test's own with a
limit under what the rank takes (cgroup v1's memory controller, or v2's; skipped where neither can be made)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HELPERS, TESTS, clean_env, expgpu
from expgpu.procs import oom

LIMIT = 1536 * 2**20


def _memory_cgroup() -> tuple[Path, str] | None:
    """A new child of this process's memory cgroup, and the file that limits it; None where none can be made."""
    for entry in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = entry.split(":", 2)
        if "memory" in controllers.split(","):
            parent, limit = oom.CGROUPS / "memory" / path.lstrip("/"), "memory.limit_in_bytes"
        elif controllers == "" and (oom.CGROUPS / "cgroup.controllers").exists():
            parent, limit = oom.CGROUPS / path.lstrip("/"), "memory.max"
        else:
            continue
        child = parent / f"expgpu-test-{os.getpid()}"
        try:
            child.mkdir(exist_ok=True)
            (child / limit).write_text(str(LIMIT))
            return child, limit
        except OSError:
            if child.exists():
                child.rmdir()
    return None


@pytest.fixture
def cgroup():
    made = _memory_cgroup()
    if made is None:
        pytest.skip("no memory cgroup can be made here (cgroup v1's memory controller, or v2's, writable as root)")
    yield made[0]
    # A process of the run still exiting keeps the cgroup busy (EBUSY): end what is left, then retry a while.
    for pid in (made[0] / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(100):
        try:
            made[0].rmdir()
            return
        except OSError:
            time.sleep(0.1)
    made[0].rmdir()


@pytest.mark.slow
@pytest.mark.parametrize("task", ["probe_oom", "script", "pool"])
def test_a_rank_the_oom_killer_ended_is_said_so_with_what_to_do(tmp_path, cgroup, task):
    """A function task's rank 1 (its supervisor's record), a script task's (its runner's) and a gpu_pool job's one
    rank (the pool's) take 3 GiB under a 1.5 GiB limit: the kernel kills it with SIGKILL, and the line says so."""
    inside = ["sh", "-c", f'echo $$ > {cgroup / "cgroup.procs"} && exec "$0" "$@"', sys.executable, "-m", "expgpu"]
    if task == "script":
        script = tmp_path / "hog.py"
        script.write_text("import os, time\nif os.environ['RANK'] == '1':\n    x = bytearray(3 * 2**30)\n"
                          "time.sleep(10)\n")
        (tmp_path / "conf" / "task").mkdir(parents=True)
        (tmp_path / "conf" / "task" / "hog.yaml").write_text(f"script: {script}\nargs: {{}}\n")
        args = ["--config-dir", str(tmp_path / "conf"), "task=hog"]
    elif task == "pool":
        env = clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_SERVER="")
        done = subprocess.run([*inside, "-m", "--config-dir", str(TESTS / "conf"), "task=probe_oom", "task.rank=0",
                               "hydra/launcher=gpu_pool", f"hydra.sweep.dir={tmp_path / 'sweep'}"], env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 1, done.stderr[-3000:]
        assert ("job #0 (task=probe_oom task.rank=0) failed: killed by SIGKILL, by the kernel's OOM killer (1 OOM "
                "kill(s) in its memory cgroup since it started)") in done.stdout + done.stderr, done.stdout[-3000:]
        return
    else:
        args = ["--config-dir", str(TESTS / "conf"), "task=probe_oom"]
    run = expgpu([*args, "launch.nproc_per_node=2"], tmp_path / "run", cmd=inside,
                 env=clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_SERVER=""))   # the ranks in the cgroup
    assert run.returncode == 1, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith(f"expgpu: rank 1 failed: {'its script was ' if task == 'script' else ''}killed by "
                           "SIGKILL, by the kernel's OOM killer (1 OOM kill(s) in its memory cgroup since it "
                           "started): it ran out of memory"), line


def test_a_sigkill_from_outside_is_not_blamed_on_memory():
    assert oom.killed_by(-9, None) == ("killed by SIGKILL (not by expgpu: kill -9, a scheduler, or the kernel's OOM "
                                       "killer)")
    assert oom.killed_by(-11, oom.OomCount()) == "killed by SIGSEGV"


def test_the_oom_kill_count_is_read_from_v1_and_v2_layouts(tmp_path):
    step = tmp_path / "memory" / "job" / "step"
    step.mkdir(parents=True)
    (step / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (tmp_path / "v1").write_text("5:cpu:/\n4:memory:/job/step\n0::/\n")
    assert oom.count_file(tmp_path / "v1", tmp_path) == step / "memory.oom_control"
    (tmp_path / "user.slice").mkdir()
    (tmp_path / "user.slice" / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    (tmp_path / "v2").write_text("0::/user.slice\n")
    assert oom.count_file(tmp_path / "v2", tmp_path) == tmp_path / "user.slice" / "memory.events"
    (tmp_path / "none").write_text("0::/elsewhere\n")
    assert oom.count_file(tmp_path / "none", tmp_path) is None
    assert oom.count_file(tmp_path / "missing", tmp_path) is None
    assert oom.OomCount(pid=2**22 + 1).since() is None   # no such process: nothing known
