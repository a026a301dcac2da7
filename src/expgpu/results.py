"""The records a run leaves for whoever reads its run dir: result.json, and why a rank or a job failed.

result.json is written once, by rank 0, when the run ends (write_result: the one writer, for function
and script tasks alike). Its keys, by kind of task:

    every run    status (finished | stopped | pruned | diverged | failed), task, function (the target; null for a
                 script), task_config, source (who started the ranks), world_size, backend (null: no
                 process group of expgpu's), strategy, plan (a row per rank: host, device, GPUs),
                 metrics (what the task returned, or a script's last logged values), steps, max_steps,
                 length_keys, stop_signal, timing (startup_s, train_s, ...), run_dir, attempts and
                 excluded_nodes (below; write_result adds them)
    a function   epochs, step_means, resumed_from_step, param_checksum, rank_checksums, and what the
                 task added with run.result_extra; timing.data_wait and each plan row's data_wait: the share
                 of train_s that run.steps waited for batches (rank 0's, each rank's; null without a loader);
                 on GPUs, each plan row has gpu_peak_reserved_mb and gpu_peak_allocated_mb (the most torch's
                 allocator held, and what tensors used of it); nonfinite, where a loss or a score that rank 0
                 logged became nan or inf: its name -> the step of its first such value (expgpu.loggers.nonfinite)
    a script     command (the argv each rank ran), exit_codes (by rank), resumed, attempt (how many times its
                 script started in this run dir before, from 0: restarts, reruns and requeues alike)

`attempts` lists the attempts of this launch, one row each, oldest first: those that failed and made the world
start again (launch.max_restarts, expgpu.launch.restarts), then this one:

    attempt      1 for the first
    kind         crash or hung for a failed attempt; this result's status for the last row
    reason       the one line it failed with (null for the last row, unless it hung)
    ranks        the rank(s) at fault: a crash's first failed rank, a hang's culprits
    step         the steps done: at a crash, the failing rank's (a script's: the last step metrics.jsonl held);
                 at a hang, the slowest rank's
    at           when it ended (ISO 8601, local time)

`excluded_nodes` lists the SLURM nodes this job left out after a crash or a hang that was one node's
(launch.exclude_bad_nodes, expgpu.launch.bad_nodes), oldest first; [] when none was (and outside SLURM):

    node         the node's name, as SLURM spells it (what `srun --exclude` takes)
    reason       why: the failed attempt's line (`rank 1 failed: ...`, `hung: ...`)
    attempt      the attempt that failed on it (as in `attempts`)
    ranks        its rank(s) at fault
    how          step: the next srun step of the same allocation ran without it (--exclude); requeue: the job
                 was requeued with it in its ExcNodeList (the allocation had no other node for the step)
    job          the SLURM job; restart: SLURM's restart count of the job then (0: before any requeue)
    at           when (ISO 8601, local time)

A failure record (RUN_DIR/.expgpu/rank<N>.failure.json, failure.json) says in one line why a rank or
the job failed, whether it was the user's error, and the node it was on (`node`: SLURM's name of it, else the
host name): the supervisor, the sweep report and a restart (which node to leave out) read them. Under SLURM
every rank also says at its start which node it runs on (RUN_DIR/.expgpu/rank<N>.node.json): a hang's culprits
write no failure record.

The process record (RUN_DIR/.expgpu/process.json), written when a run starts by the process in charge of it (rank
0, or the supervisor of its ranks), says which process that is: `pid`, `host`, `created` (the process's start, by
the OS: a pid reused later has another), `started` (when the launch began), `job` (SLURM's job id, else null),
`visible` (CUDA_VISIBLE_DEVICES then, else null). A run without result.json whose process is gone was lost (killed,
its node gone), not running: `expgpu status` reads it.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from expgpu import envvars, rundir
from expgpu.rundir import RESULT, atomic_write_bytes, attempts_file, failure_file, job_failure_file

EVERY_RUN = ("status", "task", "function", "task_config", "source", "world_size", "backend", "strategy", "plan",
             "metrics", "steps", "max_steps", "length_keys", "stop_signal", "timing", "run_dir")
FUNCTION_KEYS = ("epochs", "step_means", "resumed_from_step", "param_checksum", "rank_checksums")
SCRIPT_KEYS = ("command", "exit_codes", "resumed", "attempt")
# The statuses of a run that is over for good, with nothing to resume: it trained to its end, or it stopped on a
# request of its own (CUT_SHORT: an optimizing sweeper's pruner; a loss that became nan under task.on_nonfinite=stop).
# Stopped (a signal: resumable), failed and hung are the others.
CUT_SHORT = ("pruned", "diverged")
FINAL = ("finished", *CUT_SHORT)


def nonfinite_words(nonfinite) -> str:
    """result.json's `nonfinite` in words: `loss nan or inf from step 10`; "" for none."""
    if not isinstance(nonfinite, dict):
        return ""
    return ", ".join(f"{name} nan or inf from step {step}" for name, step in nonfinite.items())


def is_script(result: dict) -> bool:
    """Whether a result.json is a script task's (its ranks ran a command, not a function)."""
    return "command" in result


def write_result(run_dir: Path, result: dict) -> dict:
    """result.json, atomically, with its `attempts`; a record missing a key of its kind's schema is a bug,
    not a file."""
    missing = [k for k in EVERY_RUN + (SCRIPT_KEYS if is_script(result) else FUNCTION_KEYS) if k not in result]
    if missing:
        raise ValueError(f"result.json without {', '.join(missing)}")
    attempt = current_attempt()
    result = {**result, "attempts": [*read_attempts(run_dir, before=attempt), {
        "attempt": attempt, "kind": result["status"], "reason": (result.get("hang") or {}).get("line"),
        "ranks": (result.get("hang") or {}).get("culprits"), "step": result["steps"], "at": now()}],
        "excluded_nodes": read_excluded_nodes(run_dir, os.environ.get("SLURM_JOB_ID"), before=attempt)}
    atomic_write_bytes(Path(run_dir) / RESULT, (json.dumps(result, indent=2) + "\n").encode())
    return result


def current_attempt(env=None) -> int:
    """This process's attempt of the run: 1, unless a restart loop said otherwise (EXPGPU_ATTEMPT)."""
    raw = (os.environ if env is None else env).get(envvars.ATTEMPT, "")
    return int(raw) if raw.isdigit() and int(raw) >= 1 else 1


def read_attempts(run_dir: Path, before: int | None = None) -> list[dict]:
    """The failed attempts recorded in the run dir (RUN_DIR/.expgpu/attempts.json), oldest first; with
    `before`, only those numbered below it (rows left by an earlier launch in the same run dir are not)."""
    try:
        rows = json.loads(attempts_file(run_dir).read_text())
    except (OSError, ValueError):
        return []
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("attempt"), int)] if isinstance(rows, list) \
        else []
    return [r for r in rows if before is None or r["attempt"] < before]


def record_attempt(run_dir: Path, row: dict) -> list[dict]:
    """A failed attempt's row added to RUN_DIR/.expgpu/attempts.json (replacing any of its number or later, an
    earlier launch's); every row now."""
    rows = [*read_attempts(run_dir, before=row["attempt"]), row]
    path = attempts_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(rows, indent=2) + "\n").encode())
    return rows


def read_excluded_nodes(run_dir: Path, job: str | None, before: int | None = None) -> list[dict]:
    """The nodes SLURM job `job` left out (RUN_DIR/.expgpu/excluded-nodes.json), oldest first; with `before`, only
    those left out after an attempt numbered below it. [] outside SLURM (`job` None)."""
    if job is None:
        return []
    try:
        rows = json.loads(rundir.excluded_nodes_file(run_dir).read_text())
    except (OSError, ValueError):
        return []
    rows = rows if isinstance(rows, list) else []
    return [r for r in rows if isinstance(r, dict) and r.get("job") == job and isinstance(r.get("attempt"), int)
            and (before is None or r["attempt"] < before)]


def record_excluded_node(run_dir: Path, row: dict) -> list[dict]:
    """A node left out added to RUN_DIR/.expgpu/excluded-nodes.json; the rows of the same job before its attempt
    are kept (another job's, in the same run dir, are not); every row now."""
    rows = [*read_excluded_nodes(run_dir, row["job"], before=row["attempt"]), row]
    path = rundir.excluded_nodes_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(rows, indent=2) + "\n").encode())
    return rows


def node_name(env=None) -> str:
    """The node this process runs on as SLURM names it (SLURMD_NODENAME: what `srun --exclude` and ExcNodeList
    take; the name may differ from the host's, and two nodes may share one host), else the host name."""
    return (os.environ if env is None else env).get("SLURMD_NODENAME") or socket.gethostname()


def write_rank_node(run_dir: Path, rank: int, env=None) -> None:
    """Under SLURM (an srun task, or a rank an expgpu spawn inside one started): the node rank `rank` runs on in
    this attempt (RUN_DIR/.expgpu/rank<N>.node.json), which a hang's verdict (ranks only) is mapped to nodes with."""
    env = os.environ if env is None else env
    if not env.get("SLURMD_NODENAME"):
        return
    path = rundir.rank_node_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({"rank": rank, "node": node_name(env), "host": socket.gethostname(),
                                         "attempt": current_attempt(env)}).encode())


def write_process(run_dir: Path, env=None) -> None:
    """RUN_DIR/.expgpu/process.json: this process is in charge of the run (see the module's docstring)."""
    import psutil

    env = os.environ if env is None else env
    me = psutil.Process()
    job = slurm_job(env)
    started = env.get(envvars.START_TIME, "")
    path = rundir.process_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({
        "pid": me.pid, "host": socket.gethostname(), "created": me.create_time(),
        "started": float(started) if started.replace(".", "", 1).isdigit() else me.create_time(), "job": job,
        "visible": env.get("CUDA_VISIBLE_DEVICES")}).encode())


def slurm_job(env=None) -> str | None:
    """The SLURM job this process belongs to, as squeue names it (an array's task: 12_3), None outside SLURM."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if job and env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return job or None


def allocation_job(sweep_dir: Path) -> str | None:
    """The SLURM job of a slurm_pool sweep's allocation (rundir.allocation_record), None where it has none."""
    try:
        job = json.loads(rundir.allocation_record(sweep_dir).read_bytes()).get("job_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(job) if job else None


def read_process(run_dir: Path) -> dict | None:
    """RUN_DIR/.expgpu/process.json, or None (none written, or not readable)."""
    try:
        doc = json.loads(rundir.process_file(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_rank_node(run_dir: Path, rank: int) -> dict | None:
    """RUN_DIR/.expgpu/rank<N>.node.json ({rank, node, host, attempt}), or None."""
    try:
        doc = json.loads(rundir.rank_node_file(run_dir, rank).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("node"), str) else None


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def read_result(run_dir: Path) -> dict | None:
    """A run dir's result.json, or None (not written yet, or not readable)."""
    try:
        doc = json.loads((Path(run_dir) / RESULT).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass
class Failure:
    """Why a rank failed: its message, whether it was the user's error, its exit code (as Popen's), and the
    steps its run had done (None: not known, or not a task function's)."""
    rank: int
    message: str
    user_error: bool
    returncode: int
    step: int | None = None


def finished_earlier(run_dir: Path, plain: dict) -> dict | None:
    """The result of a finished run of the same task settings in this run dir (a rerun of a finished
    job: a fixed hydra.run.dir or sweep dir, a requeued slurm_pool allocation, --experimental-rerun),
    else None. checkpoint.resume=false: None (the user asked to train again)."""
    if not plain["checkpoint"]["resume"]:
        return None
    result = read_result(run_dir)
    if not isinstance(result, dict) or result.get("status") != "finished":
        return None
    same = json.dumps(result.get("task_config"), sort_keys=True) == json.dumps(plain["task"], sort_keys=True)
    return result if same else None


def write_failure(run_dir: Path, rank: int, message: str, user_error: bool = False, step: int | None = None,
                  lost_peer: bool = False, killed: bool = False, of: int | None = None) -> None:
    """Rank `rank`'s failure record. `lost_peer`: its error was a collective's peer gone (expgpu.errors.lost_peer),
    likely an echo; `killed`: its supervisor wrote it, the rank having been killed outright (a signal) first;
    `of`: the failure is that other rank's, which this one reports (`message`: "rank N failed: ...")."""
    path = failure_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({"rank": rank, "message": message, "user_error": user_error,
                                         "step": step, "node": node_name(), "lost_peer": lost_peer,
                                         "killed": killed, "of": of}).encode())


def failure_record(run_dir: Path, rank: int) -> dict:
    """Rank `rank`'s failure record as written (write_failure), {} where there is none (or not yet whole)."""
    try:
        info = json.loads(failure_file(run_dir, rank).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def write_job_failure(run_dir: Path, message: str, user_error: bool = False, rank: int | None = None,
                      step: int | None = None, lost_peer: bool = False) -> None:
    """Why the job (not one rank) failed, in one line, for `expgpu-report` whatever the launcher; `rank`: the
    rank whose own error it is (srun's tasks, each a rank, write it), None when the message names it; `step`:
    the steps that rank's run had done; `lost_peer`: the error is that rank's collective losing a peer (the
    echo of another rank's end: the first record only when that one, killed outright, wrote none)."""
    path = job_failure_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({"message": " ".join(message.split()), "user_error": user_error,
                                         "rank": rank, "step": step, "node": node_name(),
                                         "lost_peer": lost_peer}).encode())


def read_job_failure(run_dir: Path) -> dict | None:
    """RUN_DIR/.expgpu/failure.json ({message, user_error, rank, step, node}), or None."""
    try:
        doc = json.loads(job_failure_file(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and "message" in doc else None


def failure_time(run_dir: Path, rank: int) -> float | None:
    """When rank `rank` recorded its failure (its record's mtime), None where it has recorded none: the cause
    records before its process group goes down, so the earliest record is the cause, later ones its echoes.
    A rank killed outright went before all (-inf), whenever its supervisor recorded it."""
    try:
        at = failure_file(run_dir, rank).stat().st_mtime
    except OSError:
        return None
    return float("-inf") if failure_record(run_dir, rank).get("killed") else at


def read_failure(run_dir: Path, rank: int, code: int) -> Failure:
    """Rank `rank`'s failure as it recorded it, else as its exit code tells it."""
    info = failure_record(run_dir, rank)
    of = info.get("of")
    if isinstance(of, int) and of != rank and "message" in info:   # a peer's failure, which this rank reported
        return Failure(of, str(info["message"]).removeprefix(f"rank {of} failed: "), bool(info.get("user_error")),
                       code, info.get("step"))
    if "message" in info and "user_error" in info:
        return Failure(rank, info["message"], info["user_error"], code, info.get("step"))
    if code < 0:
        return Failure(rank, killed_by(code), False, code)
    return Failure(rank, f"exited with code {code}", False, code)


def ended_early(rank: int, waiting: int, step: int | None = None, timed_out: bool = False) -> Failure:
    """Rank `rank`'s process (or script) ended with code 0 while rank `waiting` still trained, whose next
    collective then lost it (or, `timed_out`, waited for it past the group's timeout): an early exit decided on
    that rank alone. A rank ends with 0 at a run's end only once every rank has passed the last collective, so no
    collective loses it there."""
    at = f" (at step {step})" if step is not None else ""
    how = "timed out waiting for it" if timed_out else "lost it"
    return Failure(rank, f"its process ended (code 0) while rank {waiting} still trained{at}: its task ended on that "
                         "rank alone (an early exit decided there: sys.exit(0) in a script, os._exit(0)), and rank "
                         f"{waiting}'s next collective {how}", False, 1)


def killed_by(code: int) -> str:
    """What a rank's negative exit code (-signal) says."""
    return f"killed by {signal.Signals(-code).name}"
