"""What a task function's code finds around it while it runs on a rank (expgpu.launch.worker): its prints written
a whole line at a time (on rank 0 only under launch.stdout=rank0), and torchrun's variables, whoever started
the rank."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from expgpu import rundir
from expgpu.procs.environ import kept

log = logging.getLogger("expgpu")


@contextlib.contextmanager
def stdout_of(run):
    """What the task prints, a line at a time: launch.stdout=rank0 sends what ranks other than 0 print to
    logs/rank<N>.out, so that a script that printed once on one process prints once on several (print()
    stays as it is)."""
    with whole_lines(sys.stdout), whole_lines(sys.stderr):
        if run.is_main or run.cfg.launch.stdout != "rank0":
            yield
            return
        path = rundir.rank_stdout(run.run_dir, run.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", buffering=1) as out, contextlib.redirect_stdout(out):
            yield


@contextlib.contextmanager
def whole_lines(stream):
    """Each line the task prints written whole, when it is printed. Python buffers a pipe or a file (an
    sbatch job's output, `| tee`) in 8 KiB blocks, so a rank's prints would come at its end; and
    PYTHONUNBUFFERED=1, the usual cure, writes print()'s text and its newline apart, so the ranks sharing
    the console cut into each other's lines ("[GPU0] Epoch 0[GPU1] Epoch 0"). Line buffering does neither."""
    try:
        before = (stream.line_buffering, stream.write_through)
        stream.reconfigure(line_buffering=True, write_through=False)
    except (AttributeError, ValueError, OSError):   # not a TextIOWrapper (captured, replaced): as it is
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(ValueError, OSError):
            stream.reconfigure(line_buffering=before[0], write_through=before[1])


@contextlib.contextmanager
def torchrun_variables(run):
    """RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE, as torchrun sets them, while the task runs,
    whoever started this rank (expgpu's spawn, srun, mpirun, one process): code written for torchrun
    reads them (nanoGPT's `ddp = int(os.environ.get('RANK', -1)) != -1`). Put back as they were after."""
    mine = {"RANK": run.rank, "LOCAL_RANK": run.local_rank, "WORLD_SIZE": run.world_size,
            "LOCAL_WORLD_SIZE": run.local_world_size}
    with kept(*mine) as before:
        for name, value in mine.items():
            if before[name] not in (None, str(value)):
                log.warning("%s=%s in the environment, but this process is rank %s of %s: %s=%s while the task "
                            "runs", name, before[name], run.rank, run.world_size, name, value)
            os.environ[name] = str(value)
        yield
