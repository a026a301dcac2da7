"""GPU leases (expgpu.pool.leases): real locks held by real processes, freed by their death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from expgpu.errors import UserError
from expgpu.gpus import inventory
from expgpu.pool import leases

pytestmark = pytest.mark.timeout(60)

GPUS = inventory([{"name": "A100", "memory_mb": 40960}, {"name": "V100", "memory_mb": 16384}], env={})


def _holder_process(fds: list[int]) -> subprocess.Popen:
    """A job stand-in: a process that inherited lease descriptors and sleeps."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=fds)


def test_a_held_lease_is_refused_to_everyone_else(tmp_path):
    first = leases.try_acquire(tmp_path, GPUS[0])
    assert first is not None
    assert leases.try_acquire(tmp_path, GPUS[0]) is None           # not even to this process again
    assert [lease.gpu.index for lease in leases.acquire_free(tmp_path, GPUS)] == [1]
    other = subprocess.run([sys.executable, "-c", (
        "import sys; from pathlib import Path; from expgpu.pool import leases; from expgpu.gpus import inventory;"
        "g = inventory([{'name': 'A100', 'memory_mb': 40960}], env={})[0];"
        "sys.exit(0 if leases.try_acquire(Path(sys.argv[1]), g) is None else 1)"), str(tmp_path)], timeout=30)
    assert other.returncode == 0, "another process got a GPU that is leased"
    first.release()
    assert leases.try_acquire(tmp_path, GPUS[0]) is not None


def test_the_job_holds_the_lease_after_hand_over_and_its_death_frees_it(tmp_path):
    lease = leases.try_acquire(tmp_path, GPUS[1])
    job = _holder_process([lease.fd])
    try:
        lease.note(pid=job.pid, sweep="sweepA", job=3)
        lease.handed_over()                      # the launcher closes its copy: the job still holds it
        assert leases.try_acquire(tmp_path, GPUS[1]) is None
        info = leases.holder(tmp_path, GPUS[1])
        assert info["pid"] == job.pid and info["job"] == 3
        assert f"pid {job.pid}" in leases.describe_holder(info)
        job.send_signal(signal.SIGKILL)          # killed outright: no clean-up code runs
        job.wait(timeout=10)
        # The stale file still names the dead pid; the kernel dropped the lock with it.
        assert str(job.pid) in leases.lock_path(tmp_path, GPUS[1]).read_text()
        assert leases.holder(tmp_path, GPUS[1]) is None
        again = leases.try_acquire(tmp_path, GPUS[1])
        assert again is not None
        again.release()
    finally:
        job.kill()
        job.wait()


def test_a_lease_lives_as_long_as_any_process_that_inherited_it(tmp_path):
    # A job's forked helper (a DataLoader worker) keeps the descriptor: the GPU stays leased
    # until it has gone too.
    lease = leases.try_acquire(tmp_path, GPUS[0])
    job = subprocess.Popen([sys.executable, "-c", (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    time.sleep(60)\n    os._exit(0)\n"
        "print(pid, flush=True)\n")], pass_fds=[lease.fd], stdout=subprocess.PIPE, text=True)
    lease.handed_over()
    helper = int(job.stdout.readline())
    job.wait(timeout=20)
    try:
        assert leases.try_acquire(tmp_path, GPUS[0]) is None, "the job's forked helper still holds it"
    finally:
        os.kill(helper, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while leases.holder(tmp_path, GPUS[0]) is not None:
        assert time.monotonic() < deadline, "the lease outlived every holder"
        time.sleep(0.05)


def test_lease_dir_from_environment_and_errors(tmp_path):
    assert leases.lease_dir(env={"EXPGPU_LEASE_DIR": str(tmp_path / "l")}) == tmp_path / "l"
    assert (tmp_path / "l").is_dir()
    assert leases.lease_dir(str(tmp_path / "c"), env={"EXPGPU_LEASE_DIR": "/nope"}) == tmp_path / "c"
    home = leases.lease_dir(env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert home == tmp_path / "cache" / "expgpu" / "leases"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="EXPGPU_LEASE_DIR"):
        leases.lease_dir(env={"EXPGPU_LEASE_DIR": str(blocker / "sub")})
    if os.getuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(UserError, match="not writable"):
            leases.lease_dir(env={"EXPGPU_LEASE_DIR": str(ro)})
