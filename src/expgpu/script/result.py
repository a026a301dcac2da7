"""How a script task ended: each rank's record, and rank 0's result.json from all of them.

Every rank writes RUN_DIR/.expgpu/script-rank<N>.json when its script ends (exit code, the stop signal
passed to it, its GPUs, the last lines of its stderr). Rank 0 reads the others' (the same launch's;
they end together, in destroy_process_group, but waits at most RECORD_WAIT_S) and writes result.json:

    status      hung: the ranks' watch found the script hung and stopped it (expgpu.script.watch; `hang`
                holds its verdict: the line, the rank(s) at fault);
                failed: a rank's script exited non-zero (or died) without a stop passed to it;
                stopped: a stop signal was passed on (the script may have exited 0 on it);
                pruned: an optimizing sweeper's pruner stopped it (expgpu.script.prune): final, not resumed;
                finished: every known rank exited 0
    exit_codes  by rank, as a shell reports them (143: killed by SIGTERM); null: not known
    metrics     the last value of each name in metrics.jsonl (expgpu.log), so objective= and the
                sweep report work as for a function's returned metrics
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import time
from pathlib import Path

from expgpu import rundir
from expgpu.errors import collective_error, lost_peer, short, timed_out
from expgpu.gpus import NodePlan
from expgpu.loggers.jsonl import ROW_KEYS, read_rows
from expgpu.procs import oom, stop_signals
from expgpu.ranks import RankInfo
from expgpu.results import Failure, ended_early, is_script, write_result
from expgpu.rundir import atomic_write_bytes

RECORD_WAIT_S = 10.0


def previous(run_dir: Path) -> dict | None:
    """An earlier attempt's result.json of a script task in this run dir, if any: RUN_DIR/result.json, else
    the last hang's (a restart after a hang moves it to hang-<N>/, expgpu.launch.restarts)."""
    doc = read_json(Path(run_dir) / rundir.RESULT)
    if doc is None:
        kept = sorted(Path(run_dir).glob(f"{rundir.HANG}-*/{rundir.RESULT}"), key=rundir.mtime)
        doc = read_json(kept[-1]) if kept else None
    return doc if doc is not None and is_script(doc) else None


def write_record(run_dir: Path, info: RankInfo, launch: str, outcome, gpus: list, names: list, device: str,
                 oom_count: oom.OomCount | None = None) -> dict:
    """This rank's record of its script's end; `oom_count`: its cgroup's OOM kills, from the script's start."""
    died = (outcome.returncode or 0) < 0 and not outcome.killed   # by a signal not expgpu's (after its grace)
    record = {"rank": info.rank, "launch": launch, "host": socket.gethostname(), "device": device, "gpus": gpus,
              "names": names, "exit_code": outcome.exit_code, "stopped_by": outcome.stopped_by,
              "signal": signal.Signals(-outcome.returncode).name if (outcome.returncode or 0) < 0 else None,
              "killed_after_grace": outcome.killed, "hung": outcome.hung, "stderr_tail": outcome.tail[-10:],
              "ended": outcome.ended, "killed_by": oom.killed_by(outcome.returncode, oom_count) if died else None,
              "collective_error": outcome.collective}
    path = rundir.script_record(run_dir, info.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(record).encode())
    return record


def collect(run_dir: Path, world_size: int, launch: str, own: dict) -> list[dict | None]:
    """Every rank's record of this launch, by rank (None: not there within RECORD_WAIT_S); `own`: this rank's."""
    records: list[dict | None] = [None] * world_size
    records[own["rank"]] = own
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        for rank in range(world_size):
            if records[rank] is None:
                doc = read_json(rundir.script_record(run_dir, rank))
                records[rank] = doc if doc is not None and doc.get("launch") == launch else None
        if all(r is not None for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def failed(record: dict) -> bool:
    """Its script failed: not a stop passed to it, not a hang (whose watch stopped it)."""
    return record["exit_code"] not in (0, None) and not record["stopped_by"] and not record.get("hung")


def first_failure(records: list[dict | None]) -> dict | None:
    """The rank that failed first: the cause; the others' failures are its echo."""
    bad = [r for r in records if r is not None and failed(r)]
    # an error of its own before the echo of one (a collective that lost its peer), whatever the clocks say:
    # a peer killed outright is seen a tick after the collective it tore down
    return min(bad, key=lambda r: (lost_peer(RuntimeError(_error_line(r))), r["ended"])) if bad else None


def failure(record: dict, run_dir: Path, spec=None, args: list[str] | None = None,
            records: list[dict | None] | None = None) -> Failure:
    """The failed rank's line; with the task's spec, the fix for a file it opened relative to the launch dir.
    A script whose own parser refused the arguments expgpu gave it (`args`, from task.args) failed on the
    user's input: a user error (exit 2, never restarted), as expgpu's own refusal of a key would be. With every
    rank's `records`, a collective that timed out names the ranks whose scripts ran on past it."""
    refused = refused_arguments(record)
    if refused is not None:
        given = f" (its arguments, from task.args: {shlex.join(args) or 'none'})" if args is not None else ""
        return Failure(record["rank"], f"task.args: the script refused its arguments: {refused}{given}; its usage: "
                                       f"{rundir.script_log(run_dir, record['rank'])}", True, 2)
    code = record["exit_code"]
    if torn_down(record):
        return Failure(record["rank"], "its script's process aborted as it exited, its Python code done with no "
                                       "traceback (SIGABRT, 'terminate called without an active exception': torch's "
                                       "gloo threads still running at the exit): where the other ranks still "
                                       "trained, their next collective lost it, so an early exit (sys.exit(0)) must "
                                       "be decided on every rank together (all its output: "
                                       f"{rundir.script_log(run_dir, record['rank'])})", False, code)
    early = ended_early_of(record, records) if records is not None else None
    if early is not None:
        return Failure(early.rank, f"{early.message} (all its output: {rundir.script_log(run_dir, early.rank)})",
                       False, code)
    held = held_up(record, records) if records is not None else None
    if held is not None:
        return Failure(record["rank"], f"{held} (all its output: {rundir.script_log(run_dir, record['rank'])})",
                       False, code)
    how = f"was {record.get('killed_by') or 'killed by ' + record['signal']}" if record.get("signal") else \
        f"exited with code {code}"
    tail = " | ".join(line.strip() for line in record["stderr_tail"][-5:] if line.strip())
    told = f"; the last lines of its stderr: {tail[-600:]}" if tail else "; it wrote nothing to stderr"
    said = _error_line(record)
    if said != _last_error(record):   # the words before an abort's C++ frames
        told = f"; before it: {short(said)}"
    where = rundir.script_log(run_dir, record["rank"])
    fix = missing_input(record["stderr_tail"], run_dir, spec) if spec is not None else None
    return Failure(record["rank"], f"its script {how}{told} (all its output: {where})" + (f". {fix}" if fix else ""),
                   False, code)


def _lines(record: dict) -> list[str]:
    """The last lines its script wrote to stderr, stripped, the blank ones left out."""
    return [line.strip() for line in record["stderr_tail"] if line.strip()]


def _last_error(record: dict) -> str:
    """The last line its script wrote to stderr, without torchrun's "[rank1]: " before it."""
    lines = _lines(record)
    return _unprefixed(lines[-1]) if lines else ""


def _unprefixed(line: str) -> str:
    return re.sub(r"^\[rank\d+\]:\s*", "", line.strip())


def _error_line(record: dict) -> str:
    """The line that says how its script failed: the last it wrote to stderr, or where it aborted (SIGABRT: NCCL's
    watchdog takes the process down on a timeout, with pages of C++ frames after its words) the first line in
    which torch.distributed said a collective failed (expgpu.script.process keeps it)."""
    said = record.get("collective_error")
    return _unprefixed(said) if said and record.get("signal") == "SIGABRT" else _last_error(record)


def ended_early_of(record: dict, records: list[dict | None]) -> Failure | None:
    """The rank whose script had exited 0 when this record's collective lost its peer (or timed out waiting):
    an early exit decided on that rank alone, the cause; this rank only noticed it. Under expgpu's spawn its
    supervisor sees the same (expgpu.launch.spawn); under srun and torchrun only these records tell it."""
    line = _error_line(record)
    if not collective_error(line):
        return None   # a connection of its own (an upload on rank 0 after the others' end) is no collective's
    gone = [r for r in records if r is not None and r["rank"] != record["rank"] and r["exit_code"] == 0
            and not r["stopped_by"] and r["ended"] <= record["ended"]]
    if not gone:
        return None
    return ended_early(min(gone, key=lambda r: r["ended"])["rank"], record["rank"],
                       timed_out=timed_out(RuntimeError(line)))


def held_up(record: dict, records: list[dict | None]) -> str | None:
    """A script whose collective timed out while other ranks' scripts ran on, in words (their records: ended
    later, or not there yet): they worked alone past the process group's timeout, and it waited for them."""
    error = _error_line(record)
    if not timed_out(RuntimeError(error)):
        return None
    later = {r["rank"]: r["ended"] - record["ended"] for r in records
             if r is not None and r["rank"] != record["rank"] and r["ended"] - record["ended"] > 1.0}
    running = [rank for rank, r in enumerate(records) if r is None]
    if not later and not running:
        return None
    on = [f"rank {rank}'s script ran on for {s:.0f} s" for rank, s in sorted(later.items())]
    on += [f"rank {rank}'s script still ran {RECORD_WAIT_S:g} s later" for rank in running]
    return (f"its script's collective timed out ({short(error)}) while {' and '.join(on)}: work "
            "one rank does alone (an evaluation, a save or a download on rank 0 only) must end within the process "
            "group's timeout (init_process_group(timeout=...) in the script) while the others wait: raise it above "
            "that work's length, or share the work out over every rank")


_TERMINATE = "terminate called without an active exception"


def torn_down(record: dict) -> bool:
    """The script's process aborted in its exit, not in its work: SIGABRT, the C++ runtime's last words for a
    thread destroyed while it ran (torch's gloo threads, when a rank exits in the middle of its peers'
    collectives or before their last message is freed), and no Python traceback before them."""
    lines = _lines(record)
    return record.get("signal") == "SIGABRT" and bool(lines) and lines[-1] == _TERMINATE and \
        not any(line.startswith("Traceback (most recent call last)") for line in lines)


# A command-line parser's refusal, exit code 2 after its usage: argparse's parser.error ("usage: train.py ...",
# then "train.py: error: unrecognized arguments: --bogus 3"), click's ("Usage: train.py [OPTIONS]", then
# "Error: No such option: --bogus"), and typer's, which rich draws in a box ("╭─ Error ───╮", "│ No such
# option: --bogus │", "╰───╯").
_USAGE = re.compile(r"^usage: ", re.IGNORECASE)
_REFUSAL = re.compile(r"^(?:\S+: error|Error): .+")
_BOX_TOP, _BOX_SIDES, _BOX_BOTTOM = re.compile(r"^╭─+ Error "), "│ ", re.compile(r"^╰─+╯$")


def refused_arguments(record: dict) -> str | None:
    """The line in which the script's argument parser refused its command line, if that is how it ended."""
    lines = [line.strip() for line in record["stderr_tail"] if line.strip()]
    if record["exit_code"] != 2 or record.get("signal") or not lines or not any(map(_USAGE.match, lines)):
        return None
    if _BOX_BOTTOM.match(lines[-1]):   # typer's box: its lines between the top and the bottom
        tops = [i for i, line in enumerate(lines) if _BOX_TOP.match(line)]
        inside = [line.strip(_BOX_SIDES) for line in lines[tops[-1] + 1:-1]] if tops else []
        return "Error: " + " ".join(inside) if inside else None
    return lines[-1] if _REFUSAL.match(lines[-1]) else None


_NO_SUCH_FILE = re.compile(r"No such file or directory: '([^']+)'")


def missing_input(stderr_tail: list[str], run_dir: Path, spec) -> str | None:
    """A relative path the script failed to open that is in the launch dir: it runs in its run dir, where only
    task.inputs are linked (nanoGPT's configurator.py, its data/): the inputs entry that fixes it."""
    for line in reversed(stderr_tail):
        found = _NO_SUCH_FILE.search(line)
        if found is None or os.path.isabs(found.group(1)):
            continue
        rel = Path(os.path.normpath(found.group(1)))
        if rel.parts[0] == ".." or not (Path(spec.launch_dir) / rel).exists() or (Path(run_dir) / rel).exists():
            return None
        entry = rel.parts[0]   # its top directory (data/ for data/shakespeare_char/train.bin), or the file
        listed = ", ".join([*(name for name, _ in spec.inputs), entry])
        return (f"The script runs in its run dir, where {rel} is not, but the launch dir has it "
                f"({Path(spec.launch_dir) / rel}): add `inputs: [{listed}]` to the task's file (or "
                f"task.inputs=[{listed}]) to link it there")
    return None


def write(cfg: dict, info: RankInfo, node: NodePlan, run_dir: Path, spec, records: list[dict | None],
          argv: list[str], resumed: bool, attempt: int, t_start: float, outcome, hang: dict | None = None) -> dict:
    """result.json from every rank's record; `hang`: the verdict of a hang (status hung)."""
    stops = [r["stopped_by"] for r in records if r is not None and r["stopped_by"]]
    # a pruner's stop is final (pruned); a signal beside it wins (stopped: resumable), as for a function task
    signalled = [s for s in stops if s != stop_signals.PRUNED]
    hung = hang is not None or any(r is not None and r.get("hung") for r in records)
    status = "hung" if hung else "failed" if first_failure(records) else "stopped" if signalled else \
        "pruned" if stops else "finished"
    rows = read_rows(Path(run_dir) / rundir.METRICS)
    metrics = {k: v for row in rows for k, v in row.items() if k not in ROW_KEYS}
    doc = {
        "status": status, "task": spec.name, "function": None, "command": argv, "task_config": cfg["task"],
        "source": info.source, "world_size": info.world_size, "backend": None, "strategy": node.strategy,
        "plan": [_plan_row(r, rank) for rank, r in enumerate(records)],
        "metrics": metrics, "steps": _steps(rows, hang), "max_steps": None, "length_keys": [],
        "exit_codes": [r["exit_code"] if r is not None else None for r in records],
        "stop_signal": _stop_signal(status, (records[0] or {}).get("stopped_by"), signalled),
        "resumed": resumed, "attempt": attempt,
        "timing": {"startup_s": round(outcome.started - t_start, 3),
                   "train_s": round(outcome.ended - outcome.started, 3)},
        "run_dir": str(run_dir),
    }
    if hang is not None:
        doc["hang"] = hang
    return write_result(run_dir, doc)


def _stop_signal(status: str, rank0s: str | None, signalled: list[str]) -> str | None:
    """The stop result.json names: PRUNED for a pruned run; rank 0's signal for a stopped one, else the first."""
    if status == "pruned":
        return stop_signals.PRUNED
    if status != "stopped":
        return None
    return rank0s if rank0s in signalled else signalled[0]


def _steps(rows: list[dict], hang: dict | None) -> int | None:
    """metrics.jsonl's last step; after a hang, the lowest step a rank still running had logged, where one had."""
    logged = [r["step"] for r in ((hang or {}).get("ranks") or {}).values() if "step" in r]
    return min(logged) if logged else rows[-1]["step"] if rows else None


def _plan_row(record: dict | None, rank: int) -> dict:
    if record is None:
        return {"rank": rank, "host": None, "device": "?", "gpus": [], "names": [], "exit_code": None}
    return {k: record[k] for k in ("rank", "host", "device", "gpus", "names", "exit_code")}


def read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
