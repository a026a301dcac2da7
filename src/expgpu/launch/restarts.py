"""In-run restarts: after a rank crashes, or hangs under launch.on_hang=restart, every rank is stopped and the
world starts again in the same run dir, up to launch.max_restarts times (torchrun's --max-restarts, for hangs
too). A function task resumes from its last checkpoint there; a script task starts its script again, with
task.resume_args where its resume_if file exists (expgpu.script.runner); both even under checkpoint.resume=false,
which is about an earlier launch's checkpoint, not this one's (`resuming`).

Two loops restart, with one policy (`decide`):
- expgpu's spawn: `supervise`, around spawn.run_node (app._supervise), when this supervisor is the run's only
  one (not one per node of a multi-node job) and no outer loop restarts it;
- scripts/expgpu.sbatch, around its srun step: after a failed step it runs
  `python -m expgpu.launch.restarts RUN_DIR ATTEMPT CODE STARTED [STEP_NODES LEFT_OUT]`, whose exit code 0
  starts the step again (leaving out the nodes it prints, launch.exclude_bad_nodes: expgpu.launch.bad_nodes)
  and any other ends the job with that code (or the job was requeued without a bad node).

Never restarted: a user error (exit 2); a stop signal (Ctrl-C, SIGTERM, SIGUSR2: the checkpoint, and a requeue
where there is one, take it from there); a hang under on_hang=fail. An attempt that fails as the one before it
did (same kind, same rank(s), same step, same reason) ends the run at once, with that failure's exit code (1
for a crash, 124 for a hang), instead of spending the attempts left on a failure that comes back.

Each failed attempt is one row of RUN_DIR/.expgpu/attempts.json (expgpu.results.record_attempt), which rank 0's
result.json lists under "attempts" beside its own. The step of a crash is the one the failing rank's run had
reached (its failure record; else, a script's, the last one metrics.jsonl held); a hang's is the slowest rank's,
from the watchdog's verdict. Before the world starts again after a hang, its
hang/ (the stacks, verdict.json) and result.json (status hung) move to hang-<N>/. The ranks learn their
attempt from EXPGPU_ATTEMPT (faults.crash_attempts reads it); one that finds it set in its own environment
belongs to an outer loop, and a supervisor there leaves restarts to it. No torch here: the supervisor's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from expgpu import envvars, rundir
from expgpu.errors import EXIT_HUNG, EXIT_USER_ERROR, Hung, UserError, WorkerFailed
from expgpu.launch import bad_nodes
from expgpu.procs import stop_signals
from expgpu.results import CUT_SHORT, Failure, current_attempt, now, read_job_failure, read_result, record_attempt

log = logging.getLogger("expgpu")

# The exit codes of a stopped run: 128 + the signal (SIGINT, SIGUSR2, SIGTERM; expgpu.errors.Stopped)
STOP_CODES = {128 + s for s in (signal.SIGINT, signal.SIGUSR2, signal.SIGTERM)}


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 0    # launch.max_restarts
    on_hang: str = "fail"    # launch.on_hang: fail | restart

    @classmethod
    def of(cls, cfg: dict) -> "Policy":
        launch = cfg.get("launch") or {}
        on_hang = launch.get("on_hang") or "fail"
        return cls(int(launch.get("max_restarts") or 0), getattr(on_hang, "value", str(on_hang)))


def in_charge(world_size: int, env=None) -> bool:
    """Whether this process's loop restarts the run: it supervises the whole world (one supervisor: not one of
    a multi-node job's, which would each restart alone), and no outer loop does (EXPGPU_ATTEMPT unset)."""
    return world_size == 1 and envvars.ATTEMPT not in (os.environ if env is None else env)


def supervise(run_dir: Path, cfg: dict, start: Callable[[int, dict], Failure | None], world_size: int = 1) -> None:
    """Start the world (`start(attempt, cfg)`: the attempt's first failure, or None when every rank succeeded)
    until an attempt succeeds; raises what ended the run when the policy restarts it no more (UserError, Hung,
    WorkerFailed)."""
    ours = in_charge(world_size)
    policy = Policy.of(cfg) if ours else Policy()
    attempt = first = current_attempt()
    if ours:
        rundir.attempts_file(run_dir).unlink(missing_ok=True)   # an earlier launch's, in this run dir
    while True:
        failure = start(attempt, cfg if attempt == first else resuming(cfg))
        if failure is None:
            return
        if failure.user_error:
            raise UserError(failure.message)
        verdict = hang_verdict(run_dir) if failure.returncode == EXIT_HUNG else None
        row = failed_attempt(run_dir, attempt, verdict, failure.message, [failure.rank], failure.step)
        rows = record_attempt(run_dir, row) if ours else [row]
        decision = decide(rows, policy, run_dir, stopping=_stopping(), checkpoint=_restarts_from(run_dir, cfg))
        if not decision.restart:
            if verdict is not None:
                raise Hung(verdict["line"], str(rundir.hang_dir(run_dir)), decision.text)
            raise WorkerFailed(failure, decision.text)
        log.warning("%s", decision.text)
        set_aside(run_dir, row)
        attempt += 1


def resuming(cfg: dict) -> dict:
    """The config of a restarted attempt: it resumes from what the attempts before it saved, whatever
    checkpoint.resume says (which is about an earlier launch's checkpoint in the run dir)."""
    return {**cfg, "checkpoint": {**cfg["checkpoint"], "resume": True}}


def _stopping() -> bool:
    """A stop signal reached this process (its ranks stop too): no restart."""
    stopper = stop_signals.current()
    return stopper is not None and stopper.received is not None


def _restarts_from(run_dir: Path, cfg: dict) -> str:
    """How the next attempt starts, as the restart's line says it."""
    if cfg.get("script") is not None:
        return "starting the script again, with task.resume_args where they apply"
    if (Path(run_dir) / rundir.CHECKPOINT).exists() or (Path(run_dir) / rundir.SHARDED_CHECKPOINT).exists():
        return "starting again from the last checkpoint"
    return "starting again from the start (no checkpoint yet: checkpoint.every_steps saves some)"


def hang_verdict(run_dir: Path) -> dict | None:
    """What the hang watchdog said (expgpu.train.watchdog), if it ended the ranks."""
    try:
        verdict = json.loads(rundir.hang_verdict(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and "line" in verdict else None


def failed_attempt(run_dir: Path, attempt: int, verdict: dict | None, message: str,
                   ranks: list[int] | None, step: int | None = None) -> dict:
    """The row of attempts.json for an attempt that failed: hung (the watchdog's `verdict`), else a crash
    (`message`, as the rank at fault said it, at `step` as its run counted them: else metrics.jsonl's last)."""
    if verdict is not None:
        steps = [int(r["step"]) for r in (verdict.get("ranks") or {}).values() if "step" in r]
        return {"attempt": attempt, "kind": "hung", "reason": verdict["line"], "ranks": verdict.get("culprits"),
                "step": min(steps) if steps else None, "at": now()}
    return {"attempt": attempt, "kind": "crash", "reason": message, "ranks": ranks,
            "step": step if step is not None else last_step(Path(run_dir) / rundir.METRICS), "at": now()}


def last_step(path: Path, tail_bytes: int = 65536) -> int | None:
    """The step of metrics.jsonl's last whole row (read from its end: it may be long), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue   # torn by a kill mid-write, or the first, partial line of the tail
    return None


@dataclass(frozen=True)
class Decision:
    restart: bool
    text: str | None   # the line to say: the restart's, or why not (None: the failure's own line, as ever)


def decide(rows: list[dict], policy: Policy, run_dir: Path, stopping: bool = False,
           checkpoint: str = "starting again from the last checkpoint") -> Decision:
    """Restart after the last of `rows` (this launch's failed attempts, oldest first), or not, and the line
    (`checkpoint`: how the next attempt starts)."""
    row = rows[-1]
    stacks = rundir.hang_dir(run_dir)
    n, total = row["attempt"], policy.max_restarts + 1
    if stopping or policy.max_restarts == 0:
        return Decision(False, None)
    hung = row["kind"] == "hung"
    if hung and policy.on_hang != "restart":
        return Decision(False, _final(row, "not restarted: launch.on_hang=fail", stacks))
    before = rows[-2] if len(rows) > 1 and rows[-2]["attempt"] == n - 1 else None
    if before is not None and same(before, row):
        return Decision(False, f"{_who(row)} {'hung' if hung else 'failed'} again{_at(row)} for the same reason "
                               f"({row['reason']}): not restarting (attempt {n} of {total})"
                               + (f"; every rank's stacks: {stacks}" if hung else ""))
    if n > policy.max_restarts:
        return Decision(False, _final(row, f"attempt {n} of {total}, no restarts left", stacks))
    if hung:
        return Decision(True, f"restart {n} of {policy.max_restarts}: hung{_at(row)} ({row['reason']}); "
                              f"{checkpoint} (this attempt's stacks: {rundir.hang_dir_of_attempt(run_dir, n)})")
    return Decision(True, f"restart {n} of {policy.max_restarts}: {_who(row)} failed: {row['reason']}{_at(row)}; "
                          f"{checkpoint}")


def same(a: dict, b: dict) -> bool:
    """Two failed attempts alike: kind, rank(s), step and reason (a hang's line but for its seconds waited)."""
    def reason(row: dict) -> str:
        return re.sub(r"\b\d+ s\b", "N s", row["reason"] or "") if row["kind"] == "hung" else row["reason"]

    return (a["kind"], a["ranks"], a["step"], reason(a)) == (b["kind"], b["ranks"], b["step"], reason(b))


def _who(row: dict) -> str:
    ranks = row.get("ranks") or []
    if not ranks:
        return "a rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(str(r) for r in ranks)}"


def _at(row: dict) -> str:
    return f" at step {row['step']}" if row.get("step") is not None else ""


def _final(row: dict, why: str, stacks: Path) -> str:
    if row["kind"] == "hung":
        return f"hung: {row['reason']} (every rank's stacks: {stacks}); {why}"
    return f"{_who(row)} failed: {row['reason']} ({why})"


def set_aside(run_dir: Path, row: dict) -> None:
    """Before the world starts again after a hang: its stacks, verdict and result.json (status hung) to
    hang-<N>/, where the next attempt's hang/ (if any) does not mix with them."""
    if row["kind"] != "hung" or not rundir.hang_dir(run_dir).is_dir():
        return
    kept = rundir.hang_dir_of_attempt(run_dir, row["attempt"])
    shutil.rmtree(kept, ignore_errors=True)   # an earlier launch's attempt of that number
    rundir.hang_dir(run_dir).rename(kept)
    result = read_result(run_dir)
    if result is not None and result.get("status") == "hung":
        (Path(run_dir) / rundir.RESULT).rename(kept / rundir.RESULT)


def after_step(run_dir: Path, attempt: int, code: int, started: float,
               alloc: bad_nodes.Allocation | None = None) -> int:
    """scripts/expgpu.sbatch's srun step `attempt` exited with `code` (not 0): 0 to start it again, else the
    exit code to end the job with. What the step left in the run dir since `started` (epoch seconds) says what
    happened, more than srun's code does (the highest of its tasks': a crash's peers, ended by
    --kill-on-bad-exit, make it 143 as a stop does); its config (.hydra/config.yaml, as the step's ranks
    composed it) says what to do. With `alloc` (the job's allocation, under SLURM) a restart after a failure
    that was one node's leaves that node out (launch.exclude_bad_nodes): the nodes the next step leaves out are
    printed on stdout, one comma-separated line, for the loop's `srun --exclude`; when the job was requeued
    without the node instead, the failure's code ends this run of the job."""
    if code == EXIT_USER_ERROR:
        return code
    cfg = _step_config(run_dir)
    if cfg is None:
        return code

    def fresh(path: Path) -> bool:
        try:
            return path.stat().st_mtime >= started - 1.0
        except OSError:
            return False

    job = read_job_failure(run_dir) if fresh(rundir.job_failure_file(run_dir)) else None
    if job is not None and job.get("user_error"):
        return code
    result = read_result(run_dir) if fresh(Path(run_dir) / rundir.RESULT) else None
    if result is not None and result.get("status") in ("stopped", *CUT_SHORT):
        return code
    verdict = hang_verdict(run_dir) if fresh(rundir.hang_verdict(run_dir)) else None
    if verdict is None and job is None and code in STOP_CODES:
        return code   # a stop signal (its checkpoint saved, perhaps a requeue under way), no failure
    message = job["message"] if job is not None else f"the srun step exited with code {code}"
    rank = job.get("rank") if job is not None else None
    if job is not None and job.get("lost_peer"):   # the first record is an echo: the cause, killed, wrote none
        message = (f"a rank was killed outright (no rank recorded an error of its own; rank {rank}'s collective "
                   f"lost its peer: {message})")
        rank = None   # nor its node: the echo's is not the one to leave out
    said = re.fullmatch(r"rank (\d+) failed: (.*)", message)
    if rank is None and said:   # an expgpu spawn's line, inside the step (launch.nproc_per_node)
        rank, message = int(said.group(1)), said.group(2)
    row = failed_attempt(run_dir, attempt, verdict, message, None if rank is None else [rank],
                         job.get("step") if job is not None else None)
    rows = record_attempt(run_dir, row)
    decision = decide(rows, Policy.of(cfg), run_dir, checkpoint=_restarts_from(run_dir, cfg))
    if decision.text is not None:
        print(f"expgpu: {decision.text}", file=sys.stderr, flush=True)
    failed = EXIT_HUNG if verdict is not None else 1 if job is not None else code
    if not decision.restart:   # the failure's own code, as under expgpu's spawn (srun's may be a peer's 143)
        return failed
    set_aside(run_dir, row)
    if alloc is None:
        return 0
    left_out = alloc.left_out
    if cfg["launch"].get("exclude_bad_nodes", True):
        left_out = bad_nodes.leave_out(run_dir, row, job, alloc,
                                       lambda text: print(f"expgpu: {text}", file=sys.stderr, flush=True))
    if left_out is None:   # requeued: this allocation runs no more steps
        return failed
    print(",".join(left_out), flush=True)
    return 0


def _step_config(run_dir: Path) -> dict | None:
    """launch.* (and whether it is a script task) from the config the step's ranks composed."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(rundir.hydra_config(run_dir))
        task = cfg.get("task") or {}
        return {"launch": OmegaConf.to_container(cfg.launch, resolve=True),
                "script": {} if ("script" in task or "module" in task) else None}
    except Exception:   # no config (the step failed before Hydra wrote it), or one we cannot read
        return None


USAGE = ("usage: python -m expgpu.launch.restarts RUN_DIR ATTEMPT CODE STARTED [STEP_NODES LEFT_OUT]\n"
         "       python -m expgpu.launch.restarts --first-attempt RUN_DIR")


def main(argv: list[str] | None = None) -> int:
    """scripts/expgpu.sbatch's: `RUN_DIR ATTEMPT CODE STARTED [STEP_NODES LEFT_OUT]` after a failed srun step
    (STEP_NODES: the nodes its step runs on, empty when srun's default; LEFT_OUT: the nodes it leaves out,
    comma-separated), and `--first-attempt RUN_DIR` (printed: the attempt a requeued job's run starts at)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--first-attempt":
        print(bad_nodes.first_attempt(Path(args[1]), os.environ), flush=True)
        return 0
    if len(args) not in (4, 6) or (len(args) == 6 and args[4] and not args[4].isdigit()):
        print(USAGE, file=sys.stderr)
        return EXIT_USER_ERROR
    alloc = None
    if len(args) == 6:
        alloc = bad_nodes.Allocation.from_env(int(args[4]) if args[4] else None,
                                              tuple(n for n in args[5].split(",") if n), os.environ)
    return after_step(Path(args[0]), int(args[1]), int(args[2]), float(args[3]), alloc)


if __name__ == "__main__":
    sys.exit(main())
