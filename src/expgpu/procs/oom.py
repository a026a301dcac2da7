"""Whether the kernel's OOM killer ended a rank: the OOM-kill count of this process's memory cgroup.

A rank killed by SIGKILL was most often killed by the kernel when memory ran out (the node's, or a job's
limit: SLURM's --mem), and the bare "killed by SIGKILL" leaves a user to guess. The kernel counts each OOM kill
in the memory cgroup of the process it killed (cgroup v2: memory.events' oom_kill, which counts the whole
subtree; v1: memory.oom_control's, since Linux 4.13). The ranks and their scripts are this process's children,
in its cgroup (or a warm server's): the count read when a rank starts and again when it was killed tells whether
the OOM killer did it. Nothing is said where no count can be read (no memory cgroup mounted, another OS).
"""

from __future__ import annotations

import signal
from pathlib import Path

from expgpu import results

CGROUPS = Path("/sys/fs/cgroup")


class OomCount:
    """The OOM kills counted in the memory cgroup of process `pid`: read at its start (the cgroup's file found
    while it lives), again once it died by a signal. A rank forked from a warm server started elsewhere (its
    EXPGPU_WARM_SERVER) is in that server's cgroup, not its supervisor's: each process's own is read."""

    def __init__(self, pid: int | str = "self", root: Path = CGROUPS):
        self.file = count_file(Path(f"/proc/{pid}/cgroup"), root)
        self.before = _count(self.file) if self.file is not None else None

    def since(self) -> int | None:
        """How many more it counts now than at the start; None where unknown."""
        now = _count(self.file) if self.file is not None else None
        return None if now is None or self.before is None else now - self.before


def count_file(proc_cgroup: Path, root: Path = CGROUPS) -> Path | None:
    """The file that counts the OOM kills of the memory cgroup a process's /proc/PID/cgroup names, None where
    there is none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for entry in lines:   # "hierarchy-ID:controllers:path"; v2's is "0::path"
        _, controllers, path = (entry.split(":", 2) + ["", ""])[:3]
        where = path.lstrip("/")
        if controllers == "":
            found = [root / where / "memory.events", root / "unified" / where / "memory.events"]
        elif "memory" in controllers.split(","):
            found = [root / "memory" / where / "memory.oom_control"]
        else:
            continue
        for file in found:
            if _count(file) is not None:
                return file
    return None


def _count(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def killed_by(code: int, count: OomCount | None) -> str:
    """What a rank's exit by signal (`code`: -signal, as Popen's) says; a SIGKILL, with whether the OOM killer sent
    it (`count`: the rank's process's, from its start)."""
    if -code != signal.SIGKILL:
        return results.killed_by(code)
    more = count.since() if count is not None else None
    if more:
        return (f"killed by SIGKILL, by the kernel's OOM killer ({more} OOM kill(s) in its memory cgroup since it "
                "started): it ran out of memory (the node's, or the job's limit: SLURM's --mem); a smaller batch, "
                "fewer data workers (each holds its own copy of what it loads) or more memory")
    return "killed by SIGKILL (not by expgpu: kill -9, a scheduler, or the kernel's OOM killer)"
