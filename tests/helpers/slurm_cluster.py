"""The real local SLURM cluster for tests (scripts/slurm-local), as a session fixture.

    from slurm_cluster import slurm_cluster  # noqa: F401

    def test_x(slurm_cluster, tmp_path):
        job = slurm_cluster.sbatch(["--wrap", "hostname"], cwd=tmp_path)
        assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"

One cluster serves every pytest session on this machine (engineers and CI run tests side
by side in one tree): it lives in a fixed directory with its own ports, a session that
finds it running uses it, and only the last session that leaves stops it (sessions
register under DIR/users, under a file lock). Accounting (MariaDB + slurmdbd) is on:
sacct gives real final states, and submitit's job.result() of a cancelled job raises
instead of hanging (scripts/slurm-local/README.md, pitfall 8).

Skips, printing why, only where a cluster cannot be started here: not root, no SLURM
packages and no apt-get, or start.sh failing. With EXPGPU_REQUIRE_SLURM=1 (.ci/run sets it
once it has installed the packages) any of these fails the tests instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO, clean_env

DIR = Path(os.environ.get("EXPGPU_TEST_SLURM_DIR", "/tmp/expgpu-slurm-tests"))
SETTINGS = {"SLURM_LOCAL_PORT_BASE": "7817", "SLURM_LOCAL_GPUS": "4", "SLURM_LOCAL_CPUS": "8",
            "SLURM_LOCAL_PARTITION": "debug", "SLURM_LOCAL_ACCOUNTING": "1"}
# Two nodes on this machine (multiple-slurmd mode: one slurmd per node name, `hostname -s`
# and localhost), for multi-node jobs. No accounting: its tests only need scontrol.
DIR_2N = Path(str(DIR) + "-2n")
SETTINGS_2N = {**SETTINGS, "SLURM_LOCAL_PORT_BASE": "7847", "SLURM_LOCAL_NODES": "2",
               "SLURM_LOCAL_ACCOUNTING": "0"}
SCRIPTS = REPO / "scripts" / "slurm-local"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server")
# States a job does not leave (squeue/scontrol/sacct spelling). REQUEUED, PENDING, RUNNING... are not.
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"}


@dataclass
class Cluster:
    dir: Path
    partition: str
    nodes: list[str]
    env: dict = field(repr=False)   # for subprocesses: SLURM_CONF, the venv first on PATH, no launcher vars

    @property
    def conf(self) -> str:
        return self.env["SLURM_CONF"]

    def run(self, cmd: list[str], timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout, check=check, **kw)

    def sbatch(self, args: list[str], cwd: Path | str, timeout: float = 30, env: dict | None = None) -> str:
        """Submit; returns the job id. The job inherits `env` (default .env), PATH included."""
        out = self.run(["sbatch", "--parsable", *args], timeout=timeout, cwd=cwd, env=env or self.env)
        return out.stdout.strip().split(";")[0]

    def state(self, job_id: str) -> str | None:
        """The job's state now; scontrol first (no lag), sacct once slurmctld has forgotten it."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        for word in out.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        out = self.run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id], check=False)
        lines = out.stdout.split()
        return lines[-1].split()[0] if lines else None   # "CANCELLED by 0" -> CANCELLED

    def sweep_cancelled(self, cmd: list[str], cwd: Path, name: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        """Run the sweep `cmd`, whose jobs are named `name`, and scancel them as soon as squeue lists them:
        how the sweep ended (its exit code, stdout, stderr) and the ids of the jobs cancelled."""
        proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not (jobs := self.run(["squeue", "-h", "-o", "%i", "--name", name]).stdout.split()):
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.5)
            self.run(["scancel", *jobs])
            out, err = proc.communicate(timeout=90)
        finally:
            proc.kill()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), jobs

    def wait_job(self, job_id: str, timeout: float = 120) -> str:
        """Wait until the job reaches a final state and return it (COMPLETED, FAILED, ...)."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in FINAL:
                return state
            time.sleep(0.25)
        self.run(["scancel", job_id], check=False)
        raise TimeoutError(f"SLURM job {job_id} still {state} after {timeout:.0f}s (cancelled it); "
                           f"logs: {self.dir}/log/slurmctld.log")


def _why_not() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "the local SLURM cluster needs root (apt-get, SlurmUser=root, mknod)"
    installed = all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch", "slurmdbd", "mariadbd"))
    if not installed and not shutil.which("apt-get"):
        return f"SLURM is not installed and there is no apt-get to install it ({' '.join(PACKAGES)})"
    return None


def _unavailable(reason: str):
    print(f"\nSLURM tests: {reason}", file=sys.stderr)
    if os.environ.get("EXPGPU_REQUIRE_SLURM") == "1":
        pytest.fail(f"EXPGPU_REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _cluster(where: Path, settings: dict):
    reason = _why_not()
    if reason:
        _unavailable(reason)
    from filelock import FileLock

    where.mkdir(parents=True, exist_ok=True)
    users = where / "users"
    users.mkdir(exist_ok=True)
    me = users / str(os.getpid())
    lock = FileLock(str(where / "users.lock"))
    with lock.acquire(timeout=600):
        me.touch()
        try:
            proc = subprocess.run(["bash", str(SCRIPTS / "start.sh"), str(where)], env=clean_env(**settings),
                                  capture_output=True, text=True, timeout=540)
        except subprocess.TimeoutExpired:
            proc = None
        if proc is None or proc.returncode != 0:
            me.unlink(missing_ok=True)
            tail = "timed out after 540 s" if proc is None else " | ".join(proc.stderr.strip().splitlines()[-3:])
            _unavailable(f"scripts/slurm-local/start.sh {where} failed: {tail}")
    venv_bin = str(Path(sys.executable).parent)
    env = clean_env(SLURM_CONF=str(where / "slurm.conf"),
                    PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=env, capture_output=True, text=True,
                           timeout=30).stdout.split()
    try:
        yield Cluster(where, proc.stdout.strip().splitlines()[-1], sorted(set(nodes)), env)
    finally:
        with lock.acquire(timeout=600):
            me.unlink(missing_ok=True)
            others = [p for p in users.iterdir() if p.name.isdigit() and Path(f"/proc/{p.name}").exists()]
            if not others:  # the last session out stops it
                subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(where)], env=env,
                               capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def slurm_cluster():
    """One node, 4 fake GPUs, 8 CPUs, accounting on."""
    yield from _cluster(DIR, SETTINGS)


@pytest.fixture(scope="session")
def slurm_cluster_2n():
    """Two nodes on this machine, 4 fake GPUs and 8 CPUs each, no accounting."""
    yield from _cluster(DIR_2N, SETTINGS_2N)


def restarts(cluster, job: str) -> int:
    """How many times SLURM restarted (requeued) the job."""
    out = cluster.run(["scontrol", "-o", "show", "job", job], check=False).stdout
    found = re.search(r"\bRestarts=(\d+)", out)
    return int(found.group(1)) if found else 0
