"""Is there a SLURM cluster to submit to, and does it know the partition? Asked before submitting.

Every question has a timeout: an unreachable controller makes scontrol retry for MessageTimeout
(10 s by default) per attempt, and sbatch would then fail halfway through a sweep.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from expgpu.errors import UserError

TOOLS = ("sbatch", "srun", "scontrol", "squeue")


def _scontrol(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"the SLURM controller did not answer `scontrol {' '.join(args)}` within {timeout_s:g} s "
                        f"({_where()}); check that slurmctld runs and is reachable, or raise "
                        "hydra.launcher.ping_timeout_s") from None


def _where() -> str:
    conf = os.environ.get("SLURM_CONF")
    return f"SLURM_CONF={conf}" if conf else "the default /etc/slurm/slurm.conf"


def _first_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return lines[0] if lines else f"exit code {proc.returncode}"


def check_tools(who: str = "hydra/launcher=slurm", instead: str = "hydra/launcher=submitit_local") -> None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise UserError(f"{who} needs SLURM's {', '.join(missing)}, not found on PATH; run from a "
                        f"SLURM login node (or `module load slurm`), or run here with {instead}")


def ping(timeout_s: float) -> None:
    proc = _scontrol(["ping"], timeout_s)
    # 22.05 prints "Slurmctld(primary) at HOST is DOWN" with exit code 1; older ones exit 0.
    if proc.returncode != 0 or " is DOWN" in proc.stdout or "UP" not in proc.stdout:
        raise UserError(f"the SLURM controller is unreachable: `scontrol ping` says {_first_line(proc)!r} "
                        f"({_where()}); check that slurmctld runs")


def partitions(timeout_s: float) -> dict[str, dict[str, str]]:
    """Name -> scontrol's fields (State, Default, MaxNodes, ...) of every partition."""
    proc = _scontrol(["-o", "show", "partition"], timeout_s)
    if proc.returncode != 0:
        raise UserError(f"`scontrol show partition` failed: {_first_line(proc)} ({_where()})")
    found = {}
    for line in proc.stdout.splitlines():
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if "PartitionName" in fields:
            found[fields["PartitionName"]] = fields
    return found


def check_partition(name: str | None, timeout_s: float) -> str:
    """The partition jobs go to (the cluster's default when `name` is None); UserError if unknown."""
    known = partitions(timeout_s)
    allowed = ", ".join(sorted(known)) or "none (the cluster has no partition)"
    if name is None:
        default = [p for p, f in known.items() if f.get("Default") == "YES"]
        if not default:
            raise UserError(f"hydra.launcher.partition is not set and the cluster has no default partition; "
                            f"allowed: {allowed}")
        return default[0]
    if name not in known:
        raise UserError(f"hydra.launcher.partition={name!r}: no such partition on this cluster; allowed: {allowed}")
    # DRAIN and INACTIVE refuse new jobs; a DOWN partition queues them (they start when it is UP).
    if known[name].get("State") in ("DRAIN", "INACTIVE"):
        raise UserError(f"hydra.launcher.partition={name!r} is {known[name]['State']}: it takes no jobs now; "
                        f"allowed: {allowed}")
    return name


def check(partition: str | None, timeout_s: float) -> str:
    check_tools()
    ping(timeout_s)
    return check_partition(partition, timeout_s)


def most_gpus_per_node(partition: str, timeout_s: float) -> int | None:
    """The most GPUs a node of `partition` has (sinfo's GRES: gpu:4, gpu:a100:4(S:0-1),...); None when sinfo
    cannot say."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%G"], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return max((gres_gpus(line) for line in proc.stdout.split()), default=0)


def gres_gpus(gres: str) -> int:
    """GPUs in one node's GRES string, every type of them: 'gpu:a100:2,gpu:t4:1,nvme:1' -> 3."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


REQUEUE_TIMEOUT_S = 60.0  # submitit waits as long for the same call


def scontrol_requeue(job: str, timeout: float = REQUEUE_TIMEOUT_S) -> None:
    """SLURM ends `job` and queues it again (a job's rank 0 before its time limit, a slurm_pool sweep's
    allocation); a UserError saying why it could not."""
    cmd = ["scontrol", "requeue", job]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise UserError(f"cannot requeue SLURM job {job}: scontrol is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"cannot requeue SLURM job {job}: `{' '.join(cmd)}` did not answer "
                        f"within {timeout:.0f} s") from None
    if proc.returncode != 0:
        why = " ".join((proc.stderr or proc.stdout or f"exit code {proc.returncode}").split())
        raise UserError(f"cannot requeue SLURM job {job}: `{' '.join(cmd)}` failed: {why} "
                        "(submit with --requeue)")
