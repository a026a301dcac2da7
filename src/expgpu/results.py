"""The records a run leaves for whoever reads its run dir: result.json, and why a rank or a job failed.

result.json is written once, by rank 0, when the run ends (write_result: the one writer, for function
and script tasks alike). Its keys, by kind of task:

    every run    status (finished | stopped | pruned | failed), task, function (the target; null for a
                 script), task_config, source (who started the ranks), world_size, backend (null: no
                 process group of expgpu's), strategy, plan (a row per rank: host, device, GPUs),
                 metrics (what the task returned, or a script's last logged values), steps, max_steps,
                 length_keys, stop_signal, timing (startup_s, train_s, ...), run_dir
    a function   epochs, step_means, resumed_from_step, param_checksum, rank_checksums, and what the
                 task added with run.result_extra
    a script     command (the argv each rank ran), exit_codes (by rank), resumed, attempt

A failure record (RUN_DIR/.expgpu/rank<N>.failure.json, failure.json) says in one line why a rank or
the job failed, and whether it was the user's error: the supervisor and the sweep report read them.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

from expgpu.rundir import RESULT, atomic_write_bytes, failure_file, job_failure_file

EVERY_RUN = ("status", "task", "function", "task_config", "source", "world_size", "backend", "strategy", "plan",
             "metrics", "steps", "max_steps", "length_keys", "stop_signal", "timing", "run_dir")
FUNCTION_KEYS = ("epochs", "step_means", "resumed_from_step", "param_checksum", "rank_checksums")
SCRIPT_KEYS = ("command", "exit_codes", "resumed", "attempt")


def is_script(result: dict) -> bool:
    """Whether a result.json is a script task's (its ranks ran a command, not a function)."""
    return "command" in result


def write_result(run_dir: Path, result: dict) -> dict:
    """result.json, atomically; a record missing a key of its kind's schema is a bug, not a file."""
    missing = [k for k in EVERY_RUN + (SCRIPT_KEYS if is_script(result) else FUNCTION_KEYS) if k not in result]
    if missing:
        raise ValueError(f"result.json without {', '.join(missing)}")
    atomic_write_bytes(Path(run_dir) / RESULT, (json.dumps(result, indent=2) + "\n").encode())
    return result


def read_result(run_dir: Path) -> dict | None:
    """A run dir's result.json, or None (not written yet, or not readable)."""
    try:
        doc = json.loads((Path(run_dir) / RESULT).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass
class Failure:
    """Why a rank failed: its message, whether it was the user's error, its exit code (as Popen's)."""
    rank: int
    message: str
    user_error: bool
    returncode: int


def write_failure(run_dir: Path, rank: int, message: str, user_error: bool = False) -> None:
    path = failure_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({"rank": rank, "message": message, "user_error": user_error}).encode())


def write_job_failure(run_dir: Path, message: str, user_error: bool = False) -> None:
    """Why the job (not one rank) failed, in one line, for `expgpu-report` whatever the launcher."""
    path = job_failure_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({"message": " ".join(message.split()), "user_error": user_error}).encode())


def read_failure(run_dir: Path, rank: int, code: int) -> Failure:
    """Rank `rank`'s failure as it recorded it, else as its exit code tells it."""
    try:
        info = json.loads(failure_file(run_dir, rank).read_text())
        return Failure(rank, info["message"], info["user_error"], code)
    except (OSError, ValueError, KeyError):
        if code < 0:
            return Failure(rank, f"killed by {signal.Signals(-code).name}", False, code)
        return Failure(rank, f"exited with code {code}", False, code)
