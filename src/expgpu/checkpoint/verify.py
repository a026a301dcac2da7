"""checkpoint.verify=true: does this task resume exactly? One command answers it.

A loop can hold state across a step boundary that no checkpoint sees (a batch fetched at the end of
a step for the next one, as nanoGPT does; a hidden state or counter of its own; a generator of its
own), and then a stopped and resumed run silently trains differently from one never stopped. This
trains the task twice in RUN_DIR/verify/: `straight` uninterrupted, and `resumed` stopped half-way
(every rank at the same step, as on SIGTERM) and rerun to the end; then it compares the two: the
parameters (every tracked module, every rank) and every logged row. It names the first logged step
that differs and what usually causes a difference there. Loggers are off in the copies (metrics.jsonl
is kept), so an experiment tracker shows the run, not its check.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from expgpu import envvars, rundir
from expgpu.errors import UserError, _Outcome
from expgpu.loggers.progress import PACE
from expgpu.procs import stop_signals
from expgpu.rundir import atomic_write_bytes

log = logging.getLogger("expgpu")
REPORT = "verify.json"


class NotExact(_Outcome):
    """The resumed copy differs from the uninterrupted one: shown as one line, exit code 1."""


def verify(plain: dict, info, run_dir: Path, train: Callable[[dict, Path], dict | None]) -> dict | None:
    """Train the two copies with `train(cfg, dir)` (rank 0 gets the result dict), compare, report.
    Returns the uninterrupted copy's result (rank 0); raises NotExact when the copies differ."""
    if info.world_size > 1:
        raise UserError(f"checkpoint.verify trains the task three times itself, which the processes {info.source} "
                        "started cannot restart together; run it from one process with launch.nproc_per_node=N")
    root = Path(run_dir) / "verify"
    shutil.rmtree(root, ignore_errors=True)   # a check of its own, never a resume of an older one
    for copy in ("straight", "resumed"):
        (root / copy).mkdir(parents=True)
    cfg = {**plain, "checkpoint": {**plain["checkpoint"], "verify": False, "resume": True},
           "logger": {name: None for name in plain["logger"]}}
    straight = train(cfg, root / "straight")
    _stopped_by_user(straight)
    done = straight["steps"]
    if done < 2:
        raise UserError(f"checkpoint.verify: the task trained {done} step(s); stopping it half-way needs 2 or more")
    half = done // 2
    _train_stopped_and_resumed(cfg, root, train, half)
    resumed = json.loads((root / "resumed" / rundir.RESULT).read_text())
    report = compare(root / "straight", straight, root / "resumed", resumed, half)
    atomic_write_bytes(Path(run_dir) / REPORT, (json.dumps(report, indent=2) + "\n").encode())
    if not report["exact"]:
        raise NotExact(f"checkpoint.verify: {report['summary']} ({Path(run_dir) / REPORT})")
    log.info("checkpoint.verify: %s (%s)", report["summary"], Path(run_dir) / REPORT)
    return straight


def _train_stopped_and_resumed(cfg: dict, root: Path, train, half: int) -> None:
    os.environ[envvars.STOP_AT] = str(half)   # read by every rank (spawned workers inherit it)
    try:
        stopped = train(cfg, root / "resumed")
    finally:
        del os.environ[envvars.STOP_AT]
    stopper = stop_signals.current()
    if stopper is not None:   # the copy's stop was ours (in this process, one rank): the next run must not see it
        stopper.received = stopper.agreed = None
    if stopped["status"] == "stopped" and stopped["steps"] < half:
        _stopped_by_user(stopped)   # a signal of the user's came first
    if stopped["status"] != "stopped" or stopped["steps"] != half:
        raise UserError(f"checkpoint.verify: the copy to stop at step {half} ended {stopped['status']} at step "
                        f"{stopped['steps']}: a loop that does not run on run.steps cannot be stopped there")
    train(cfg, root / "resumed")


def _stopped_by_user(result: dict | None) -> None:
    """A real Ctrl-C / SIGTERM during the check ends it, as it ends any run."""
    from expgpu.errors import Stopped

    if result is not None and result["status"] == "stopped":
        raise Stopped(result, 128 + 15, "checkpoint.verify did not finish: run it again")


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = {}
    for line in (run_dir / rundir.METRICS).read_text().splitlines():
        row = json.loads(line)
        for timed in ("time", *PACE):   # the clock's, not the task's
            row.pop(timed, None)
        rows[row.pop("step")] = row
    return rows


def compare(straight_dir: Path, straight: dict, resumed_dir: Path, resumed: dict, half: int) -> dict:
    """What differs between the uninterrupted copy and the one stopped at `half` and resumed."""
    a, b = _rows(straight_dir), _rows(resumed_dir)
    differ = sorted(s for s in a.keys() | b.keys() if a.get(s) != b.get(s))
    params_equal = straight["rank_checksums"] == resumed["rank_checksums"]
    returned_equal = straight["metrics"] == resumed["metrics"]
    report = {"stopped_at": half, "steps": straight["steps"], "rows": len(a), "params_equal": params_equal,
              "returned_equal": returned_equal, "first_differing_step": differ[0] if differ else None,
              "exact": params_equal and returned_equal and not differ}
    if report["exact"]:
        report["summary"] = (f"exact: stopped at step {half} of {straight['steps']} and resumed, it ends with the "
                             f"parameters, the {len(a)} logged rows and the returned metrics of the uninterrupted run")
        return report
    if differ:
        step = differ[0]
        before = max((s for s in a if s < step), default=None)
        names = sorted(k for k in (a.get(step) or {}).keys() | (b.get(step) or {}).keys()
                       if (a.get(step) or {}).get(k) != (b.get(step) or {}).get(k))
        shown = ", ".join(f"{k} {(a.get(step) or {}).get(k)!r} uninterrupted, {(b.get(step) or {}).get(k)!r} resumed"
                          for k in names[:2])
        window = f" (the rows before it agree up to step {before})" if before is not None else ""
        what = f"the logged rows first differ at step {step}{window}: {shown}; {_cause(step, half)}"
    elif not params_equal:
        what = ("every logged row agrees, but the parameters differ: a module or optimizer the loop uses is "
                "not passed to run.track, or state of its own changes a buffer")
    else:
        what = (f"the returned metrics differ ({straight['metrics']} uninterrupted, {resumed['metrics']} resumed): "
                "what the function computes after the loop depends on state a checkpoint does not hold")
    report["summary"] = f"NOT exact: stopped at step {half} of {straight['steps']} and resumed, {what}"
    return report


def _cause(step: int, half: int) -> str:
    """What usually makes the rows differ first at `step` after a resume at `half`."""
    if step <= half:
        return ("before the stop, so not the resume: the task is not deterministic (two uninterrupted runs "
                "would differ too: nondeterministic GPU kernels, threads racing)")
    if step == half + 1:
        return ("the first step after the resume: state the loop carries across a step boundary that no "
                "checkpoint holds, e.g. a batch fetched at the end of a step for the next one, a hidden state "
                "or counter in a variable of its own (name them: run.steps(..., keep=('x', 'y', 'hidden'))), "
                "an iterator of its own (iterate run.steps(loader))")
    return (f"{step - half} steps after the resume: state that acts only now and then (a scheduler, an "
            "optimizer or a module not passed to run.track), or random numbers from a generator of the "
            "task's own (torch.Generator, np.random.default_rng, a dataset's or worker_init_fn's) that no "
            "checkpoint holds")
