"""SLURM's queue, asked once for every job `expgpu status` wonders about: which are pending, which run.

One `squeue` call for all the job ids (one id per line, array tasks each on their own: `-r`), with a timeout;
where squeue is not installed, or does not answer, the answer is None and the rows keep what their files say.
"""

from __future__ import annotations

import shutil
import subprocess

TIMEOUT_S = 5.0


def states(jobs: list[str], timeout_s: float = TIMEOUT_S) -> dict[str, str] | None:
    """Job id -> SLURM state (PENDING, RUNNING, ...) of those of `jobs` still in the queue; None when squeue
    could not be asked. A job absent from the answer has left the queue."""
    if not jobs:
        return {}
    squeue = shutil.which("squeue")
    if squeue is None:
        return None
    try:
        out = subprocess.run([squeue, "-h", "-r", "-o", "%i|%T", "-j", ",".join(sorted(set(jobs)))],
                             capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        return None   # the controller is down, ...: nothing known
    found = {}
    for line in out.stdout.splitlines():
        job, sep, state = line.strip().partition("|")
        if sep:
            found[job] = state.split()[0] if state.split() else state
    return found
