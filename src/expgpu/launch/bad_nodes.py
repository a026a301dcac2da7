"""A bad node left out on SLURM (launch.exclude_bad_nodes, default true): after a crash or a hang that was one
node's, scripts/expgpu.sbatch's restart (expgpu.launch.restarts.after_step) runs without that node.

One node's: a crash's failing rank ran there; a hang's culprits (the watchdog's verdict) all ran there. Which
node a rank ran on: its own record, written at its start under SLURM (RUN_DIR/.expgpu/rank<N>.node.json, SLURM's
name of the node: two node names may share a host, and `srun --exclude` takes SLURM's), else, for a crash, the
failure record's `node`. A hang of ranks on several nodes, or a rank whose node is not known, leaves no node out.

How, when the restart policy restarts (never instead of it, never beyond launch.max_restarts):
1. in the same allocation, when it holds enough other nodes for the step: the next srun step runs with
   --exclude=<every node left out so far>. The step keeps its shape (nodes x tasks per node), so that is when
   the step runs on fewer nodes than the allocation holds: EXPGPU_SPARE_NODES in scripts/expgpu.sbatch;
2. else the job is requeued without it, when the partition has enough usable nodes (not down, drained, failing
   or not responding) outside the job's ExcNodeList for the job's node count: `scontrol requeue`, then
   `scontrol update ExcNodeList=...` (SLURM refuses to change a running job's ExcNodeList, and takes it for the
   job the requeue made pending again; this process ignores the requeue's SIGTERM meanwhile). The requeued run
   goes on counting attempts (first_attempt), so max_restarts still bounds them;
3. else (no other node, the job not requeueable) it restarts on the same nodes, as without this setting, and a
   line says why the node was not left out: a failure that comes back the same way stops at the repeat.
A node left out is one row of RUN_DIR/.expgpu/excluded-nodes.json, which rank 0's result.json lists under
`excluded_nodes` (expgpu.results). Not under expgpu's own spawn (one machine), and not under
hydra/launcher=slurm: expgpu does not requeue a failed submitit job (its failure ends the job, and the sweep
reports it), so there is no later run to leave a node out of.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from expgpu.errors import UserError
from expgpu.launch import requeue
from expgpu.results import now, read_excluded_nodes, read_rank_node, record_excluded_node

SLURM_TIMEOUT_S = 30.0
# sinfo's short states (%t) of a node no job starts on; a trailing `*` is a node not responding
UNUSABLE = ("down", "drain", "drng", "fail", "failg", "maint", "inval", "unk", "npc", "futr", "boot")


@dataclass(frozen=True)
class Allocation:
    """What scripts/expgpu.sbatch's restart loop knows of its job."""
    job: str
    nodes: tuple[str, ...]             # the allocation's nodes
    step_nodes: int | None             # the nodes an srun step runs on (None: srun's default, every node)
    left_out: tuple[str, ...] = ()     # the nodes its steps leave out already
    partition: str | None = None
    restart: int = 0                   # SLURM_RESTART_COUNT: 0 before any requeue

    @classmethod
    def from_env(cls, step_nodes: int | None, left_out: tuple[str, ...], env: Mapping[str, str]) -> "Allocation | None":
        job = env.get("SLURM_JOB_ID")
        if not job:
            return None
        restart = env.get("SLURM_RESTART_COUNT", "")
        return cls(job, tuple(hostnames(env.get("SLURM_JOB_NODELIST", ""))), step_nodes, left_out,
                   env.get("SLURM_JOB_PARTITION") or None, int(restart) if restart.isdigit() else 0)


@dataclass(frozen=True)
class Choice:
    how: str                   # step (the next srun step leaves it out), requeue, or none (not left out)
    node: str
    exclude: tuple[str, ...]   # step: the nodes the next step leaves out; requeue: the job's ExcNodeList
    text: str                  # the line to say


def node_of(run_dir: Path, row: dict, job_failure: dict | None) -> str | None:
    """The one node the failed attempt `row`'s rank(s) at fault ran on, or None (several nodes, or one not known).
    `job_failure`: this attempt's RUN_DIR/.expgpu/failure.json, if any."""
    ranks = row.get("ranks") or []
    nodes = set()
    for rank in ranks:
        node = None
        mine = read_rank_node(run_dir, rank)
        if mine is not None and mine.get("attempt") == row["attempt"]:
            node = mine["node"]
        elif row["kind"] == "crash" and job_failure is not None and job_failure.get("rank") == rank:
            node = job_failure.get("node")
        if node is None:
            return None
        nodes.add(node)
    return nodes.pop() if len(nodes) == 1 else None


def choose(node: str, alloc: Allocation, job_excluded: Callable[[str], list[str]] | None = None,
           usable: Callable[[str | None], list[str] | None] | None = None) -> Choice:
    """How `node` is left out of `alloc`'s job (module docstring); `job_excluded(job)`: the job's ExcNodeList,
    `usable(partition)`: the partition's usable nodes, None when SLURM could not say (both asked only for a
    requeue)."""
    out = tuple(dict.fromkeys((*alloc.left_out, node)))
    others = [n for n in alloc.nodes if n not in out]
    if alloc.step_nodes is not None and len(others) >= alloc.step_nodes:
        return Choice("step", node, out, f"node {node} left out: the next srun step runs on {alloc.step_nodes} of "
                                         f"the allocation's other nodes ({', '.join(others)})")
    need = len(alloc.nodes)   # a requeued job asks for as many nodes as this one has
    why = (f"the allocation has no other node for its {alloc.step_nodes}-node step" if alloc.step_nodes is not None
           else "its srun step uses every node of the allocation")
    excluded = tuple(dict.fromkeys([*(job_excluded or excluded_of)(alloc.job), *out]))
    free = (usable or usable_nodes)(alloc.partition)
    where = f"partition {alloc.partition}" if alloc.partition else "the partition"
    if free is None:
        return Choice("none", node, (), f"node {node} not left out: {why}, and SLURM did not say which nodes "
                                        f"{where} has; restarting on the same nodes")
    left = [n for n in free if n not in excluded]
    if len(left) < need:
        return Choice("none", node, (), f"node {node} not left out: {why}, and {where} has {len(left)} usable "
                                        f"node(s) outside {','.join(excluded)}, fewer than the job's {need}; "
                                        "restarting on the same nodes")
    return Choice("requeue", node, excluded, f"node {node} left out: {why}; requeueing job {alloc.job} with "
                                             f"ExcNodeList={','.join(excluded)} ({where} has {len(left)} other "
                                             "usable node(s))")


def leave_out(run_dir: Path, row: dict, job_failure: dict | None, alloc: Allocation,
              say: Callable[[str], None]) -> tuple[str, ...] | None:
    """After the restart policy chose to restart failed attempt `row`: the nodes the next srun step leaves out,
    or None when the job was requeued without the node (this allocation runs no more steps)."""
    node = node_of(run_dir, row, job_failure)
    if node is None:
        return alloc.left_out
    choice = choose(node, alloc)
    if choice.how == "requeue":
        failed, note = requeue_without(alloc.job, choice.exclude)
        if failed:   # not requeued: the same nodes
            say(f"node {node} not left out: {note}; restarting on the same nodes")
            return alloc.left_out
        choice = Choice(choice.how, node, choice.exclude, choice.text + (f"; but {note}" if note else ""))
    say(choice.text)
    if choice.how == "none":
        return alloc.left_out
    record_excluded_node(run_dir, {
        "node": node, "reason": _reason(row), "attempt": row["attempt"], "ranks": row.get("ranks"),
        "how": choice.how, "job": alloc.job, "restart": alloc.restart, "at": now()})
    return choice.exclude if choice.how == "step" else None


def _reason(row: dict) -> str:
    if row["kind"] == "hung":
        return f"hung: {row['reason']}"
    ranks = row.get("ranks") or []
    return f"rank {ranks[0]} failed: {row['reason']}" if len(ranks) == 1 else f"failed: {row['reason']}"


def first_attempt(run_dir: Path, env: Mapping[str, str]) -> int:
    """The attempt a run of the job starts at: 1, or, right after expgpu requeued it to leave a node out, the one
    after the attempt that failed there (the attempts go on: launch.max_restarts bounds them across requeues)."""
    restart = env.get("SLURM_RESTART_COUNT", "")
    rows = read_excluded_nodes(run_dir, env.get("SLURM_JOB_ID"))
    if rows and rows[-1].get("how") == "requeue" and restart.isdigit() and rows[-1].get("restart") == int(restart) - 1:
        return rows[-1]["attempt"] + 1
    return 1


def requeue_without(job: str, nodes: tuple[str, ...]) -> tuple[bool, str | None]:
    """Requeue `job` with `nodes` as its ExcNodeList: (failed, what to say): (True, why) when it was not requeued;
    (False, why) when it was, but without the list (it may start on the node again). This process ignores SIGTERM
    from here on: the requeue signals every process of the job, and the update comes after it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        requeue.scontrol_requeue(job, timeout=SLURM_TIMEOUT_S)
    except UserError as e:
        return True, str(e)
    listed = ",".join(nodes)
    why = "scontrol did not answer"
    for _ in range(10):   # the requeue made it pending again by the time `scontrol requeue` returned; a few tries
        proc = _run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={listed}"])
        if proc is not None and proc.returncode == 0:
            return False, None
        why = _first_line(proc) if proc is not None else why
        time.sleep(0.5)
    return False, f"`scontrol update JobId={job} ExcNodeList={listed}` failed ({why}): it may start there again"


def hostnames(expr: str) -> list[str]:
    """A SLURM host list (node[01-03],gpu7) as names; [] for none; the expression split at commas, if scontrol
    cannot say."""
    if not expr or expr == "(null)":
        return []
    proc = _run(["scontrol", "show", "hostnames", expr])
    if proc is None or proc.returncode != 0:
        return [n for n in expr.split(",") if n]
    return proc.stdout.split()


def excluded_of(job: str) -> list[str]:
    """The job's ExcNodeList now (what it was submitted with, `--exclude`, and earlier requeues)."""
    proc = _run(["scontrol", "-o", "show", "job", job])
    if proc is None or proc.returncode != 0:
        return []
    for word in proc.stdout.split():
        if word.startswith("ExcNodeList="):
            return hostnames(word.split("=", 1)[1])
    return []


def usable_nodes(partition: str | None) -> list[str] | None:
    """The nodes of `partition` (the default one when None) a job may start on, or None when sinfo cannot say."""
    proc = _run(["sinfo", "-h", "-N", "-o", "%N %t", *(["-p", partition] if partition else [])])
    if proc is None or proc.returncode != 0:
        return None
    found = {}
    for line in proc.stdout.splitlines():
        name, _, state = line.strip().partition(" ")
        ok = not state.endswith("*") and not state.rstrip("~#!%$@^-+").startswith(UNUSABLE)
        found[name] = found.get(name, True) and ok
    return [n for n, ok in found.items() if ok]


def _run(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _first_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return lines[0] if lines else f"exit code {proc.returncode}"


__all__ = ["Allocation", "Choice", "choose", "first_attempt", "leave_out", "node_of", "requeue_without"]
