"""A script task run as an optimizing sweeper's trial is pruned as a function task is: rank 0's supervisor
reports the objective from the rows the script logs with expgpu.log (expgpu.script.loggers feeds them to the
TrialReporter of expgpu.tune.bridge, which expgpu.launch.worker hands it; the script, told the objective's name
in EXPGPU_SCRIPT_PROMPT, writes those rows at once), and when the study's pruner says so, a PRUNED stop is
requested.

The ranks share no store (the script makes its own process group), only the run dir, so rank 0 first makes
RUN_DIR/.expgpu/script-pruned-<launch> and then stops its script (SIGTERM, as for any stop; grace_s, then
SIGKILL); every other rank's supervisor looks for that file twice a second and stops its own. A rank whose
script exits non-zero while the file is there (its peer's death broke a collective before its own SIGTERM
came) is pruned too, not failed: the file is made before rank 0's script is signalled. result.json says
`"status": "pruned"` and the job exits 0, so the sweeper counts the trial PRUNED and its slot takes the next.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from expgpu import envvars, rundir
from expgpu.procs import stop_signals
from expgpu.rundir import atomic_write_bytes

LOOK_EVERY_S = 0.1   # how often a rank other than 0 looks for rank 0's prune (a stat: cheap)


def is_trial() -> bool:
    return bool(os.environ.get(envvars.TRIAL))


class PeerPrune:
    """On a rank other than 0 of a trial: rank 0's prune, seen in the run dir, becomes this rank's PRUNED stop."""

    def __init__(self, run_dir: Path, launch: str, stopper):
        self.path, self.stopper = rundir.script_pruned(run_dir, launch), stopper
        self.looked = 0.0

    def poll(self) -> None:
        if self.stopper.received is not None or time.monotonic() - self.looked < LOOK_EVERY_S:
            return
        self.looked = time.monotonic()
        if self.path.exists():
            self.stopper.request(stop_signals.PRUNED)


def announce(run_dir: Path, launch: str) -> None:
    """Rank 0, its pruner having said prune: the other ranks stop their scripts too."""
    path = rundir.script_pruned(run_dir, launch)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, b"")


def pruned(run_dir: Path, launch: str) -> bool:
    return rundir.script_pruned(run_dir, launch).exists()
