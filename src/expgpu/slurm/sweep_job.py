"""`hydra/launcher=slurm_pool`: a whole sweep (or study) as one SLURM job, its trials packed onto the
allocation's GPUs by gpu_pool inside it (expgpu.pool.allocation): one queue wait, not one per trial.

From the login node the launcher writes an sbatch script that runs the same command again, with
`hydra/launcher=gpu_pool` and this sweep dir, submits it, and follows it: the job's state while it
waits in the queue, then its output (the pool's board) as it runs; the command exits with the sweep's
own exit code. Ctrl-C while following detaches (the job runs on) and says how to follow again:

    python -m expgpu.slurm.sweep_job SWEEP_DIR          # follow again (or: tail -f its output)

SWEEP_DIR/.slurm_pool/ holds the script, the job's record (job.json: id, output, exit file) and its
output; the job writes its command's exit code to exit-<job id> as its last act, so a job that ended
without one (scancel, a node lost, the time limit) is told apart from one that finished. Results,
pool.json, report.html and optimization_results.yaml land in SWEEP_DIR as for a local sweep: the
command inside writes them. With an optimizing sweeper the study runs inside the allocation, asking
for the next trial as any slot frees.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from expgpu import results, rundir
from expgpu.errors import RunDirBusy, UserError, shown
from expgpu.rundir import atomic_write_bytes
from expgpu.slurm import cluster, resources
from expgpu.slurm.follow import SLURM_CALL_S, follow, state_of
from expgpu.task import precheck

STATE = rundir.SLURM_POOL
# The allocation's own keys (hydra.launcher.*); `pool` holds gpu_pool's, passed to the sweep inside
ALLOCATION_KEYS = ("partition", "nodes", "gpus_per_node", "cpus_per_node", "mem_gb", "timeout_min", "account", "qos",
                   "constraint", "additional_parameters", "pool", "detach", "ping_timeout_s", "max_requeues",
                   "signal_delay_s")


def inner_argv(argv: Sequence[str], sweep_dir: Path, pool: Mapping[str, Any]) -> list[str]:
    """The command to run inside the allocation: this one, with gpu_pool for slurm_pool (named on the command
    line, or added: a config may have chosen slurm_pool), without the allocation's own keys, in this sweep dir."""
    out, named = [], False
    for word in argv:
        if word.startswith(("hydra/launcher=", "hydra.launcher=")):
            out.append("hydra/launcher=gpu_pool")
            named = True
        elif word.lstrip("+~").startswith(("hydra.launcher.", "hydra.sweep.dir=")):
            continue
        else:
            out.append(word)
    if not named:
        out.append("hydra/launcher=gpu_pool")
    out += [f"hydra.launcher.{k}={_value(v)}" for k, v in pool.items() if v is not None]
    return out + [f"hydra.sweep.dir={sweep_dir}"]


def _value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, dict, bool)) else str(v)


def sbatch_script(params: Mapping[str, Any], command: Sequence[str], cwd: Path, state: Path) -> str:
    """The allocation: nodes x gpus_per_node GPUs (none: the jobs take CPU slots), whole nodes unless
    cpus_per_node is given, the time limit, partition, account, qos, requeueable with SLURM's warning before
    its time limit; its body runs `command` in `cwd` and records its exit code."""
    gres = [f"#SBATCH --gres=gpu:{params['gpus_per_node']}"] if params["gpus_per_node"] else []
    lines = ["#!/bin/bash", "#SBATCH --job-name=expgpu-sweep", f"#SBATCH --nodes={params['nodes']}",
             "#SBATCH --ntasks-per-node=1", *gres,
             f"#SBATCH --time={int(params['timeout_min'])}", f"#SBATCH --output={state}/allocation-%j.out",
             "#SBATCH --open-mode=append"]
    if params.get("max_requeues"):
        lines += ["#SBATCH --requeue", f"#SBATCH --signal=B:USR2@{int(params.get('signal_delay_s') or 120)}"]
    cpus = params.get("cpus_per_node")
    lines.append(f"#SBATCH --cpus-per-task={cpus}" if cpus else "#SBATCH --exclusive")
    if params.get("mem_gb"):
        lines.append(f"#SBATCH --mem={params['mem_gb']}G")
    for key in ("partition", "account", "qos", "constraint"):
        if params.get(key):
            lines.append(f"#SBATCH --{key}={params[key]}")
    for key, value in (params.get("additional_parameters") or {}).items():
        lines.append(f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={value}")
    exit_file = f'{shlex.quote(str(state))}/exit-"$SLURM_JOB_ID"'
    return "\n".join(lines + [
        "", f"rm -f {exit_file}   # a requeued run's: the exit code is this run's",
        "# the sweep, with hydra/launcher=gpu_pool: each of its jobs on the GPUs (CPU slots) it was given, on its "
        "node(s)",
        f"cd {shlex.quote(str(cwd))}", shlex.join(command) + " &", "sweep=$!",
        "# SLURM's warning before the time limit (--signal=B:USR2) reaches this shell only: the sweep saves and",
        "# requeues. SIGTERM (a preemption, scancel, scontrol requeue) reaches the sweep too; this shell waits on.",
        "trap 'kill -USR2 $sweep 2>/dev/null' USR2", "trap 'kill -TERM $sweep 2>/dev/null' TERM",
        'while kill -0 "$sweep" 2>/dev/null; do wait "$sweep"; done', 'wait "$sweep"; code=$?',
        f'echo "$code" > {exit_file}', 'exit "$code"', ""])


# The allocation's whole-number settings: the least each may be, and what it is
WHOLE = {"nodes": (1, "the allocation's nodes"),
         "gpus_per_node": (0, "the allocation's GPUs on each node; 0: none, the jobs take CPU slots"),
         "timeout_min": (1, "the allocation's time limit in minutes"),
         "max_requeues": (0, "how often the allocation may requeue itself before its time limit"),
         "signal_delay_s": (1, "seconds before the time limit that SLURM warns the sweep")}


def check(params: Mapping[str, Any]) -> None:
    """The allocation's settings, one line each, before anything is submitted."""
    for key, (low, meaning) in WHOLE.items():
        value = params.get(key, 0 if key == "max_requeues" else None)   # the others must be given
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"hydra.launcher.{key}={shown(value)} is not allowed: an integer >= {low} ({meaning})")
    resources.count(params, "cpus_per_node", 1, "slurm_pool", "whole nodes")
    resources.count(params, "mem_gb", 1, "slurm_pool", "SLURM's default")
    pool = dict(params.get("pool") or {})
    unknown = sorted(set(pool) - POOL_KEYS)
    if unknown:
        raise UserError(f"hydra.launcher.pool.{unknown[0]}: not a key of gpu_pool inside the allocation; allowed: "
                        + ", ".join(sorted(POOL_KEYS)))
    if params["gpus_per_node"] == 0 and pool.get("gpus_per_job"):
        raise UserError(f"hydra.launcher.pool.gpus_per_job={shown(pool['gpus_per_job'])} is not allowed with "
                        "hydra.launcher.gpus_per_node=0 (an allocation without GPUs, whose jobs take CPU slots): "
                        "null or 0")
    from expgpu.pool import sharing
    from expgpu.pool.settings import settings

    try:   # gpu_pool's own checks, now rather than in the allocation after the queue
        s = settings(pool_params(pool))
        if params["gpus_per_node"] == 0 and s.jobs_per_gpu > 1:
            raise UserError(f"hydra.launcher.jobs_per_gpu={s.jobs_per_gpu} shares GPUs, and "
                            "hydra.launcher.gpus_per_node=0 asks for none (its jobs take CPU slots): drop it, or give "
                            "more jobs at once with hydra.launcher.cpu_slots")
        sharing.check_in_allocation(s, True)
    except UserError as e:   # the pool's keys are under hydra.launcher.pool here
        raise UserError(re.sub(r"hydra\.launcher\.(?!gpus_per_node)", "hydra.launcher.pool.", str(e))) from None


def pool_params(pool: Mapping[str, Any]) -> dict:
    """gpu_pool's hydra.launcher inside the allocation: its GPUs are the allocation's (its CPU slots are read
    only in an allocation without GPUs)."""
    return {"gpus": "all", "cpu_slots": 1, "grace_s": 15.0, **pool}


def inside(params: Mapping[str, Any]) -> dict:
    """gpu_pool's settings inside the allocation: hydra.launcher.pool.*, and how often it may requeue itself."""
    pool = dict(params.get("pool") or {})
    if not params.get("gpus_per_node"):   # CPU slots even where the allocation is given its nodes' GPUs
        pool["gpus_per_job"] = 0          # (--exclusive gives them)
    elif pool.get("gpus_per_job") != 0:
        pool.pop("cpu_slots", None)   # read only where the jobs take CPU slots
    return {**pool, "max_requeues": params.get("max_requeues") or 0}


# gpu_pool's keys that mean something inside an allocation (its GPUs are the allocation's: no gpus, lease_dir)
POOL_KEYS = frozenset({"gpus_per_job", "max_parallel", "wait_timeout_s", "grace_s", "threads_per_job", "nodes",
                       "warm_starts", "timeout_min", "cpu_slots", "jobs_per_gpu"})


def whole_nodes(params: Mapping[str, Any]) -> bool:
    """GPUs asked for on whole nodes (no cpus_per_node: --exclusive), to which SLURM gives every GPU they have
    (sbatch(1): an exclusive job "is allocated all CPUs and GRES on all nodes"); the sweep uses them all."""
    return bool(params["gpus_per_node"]) and not params.get("cpus_per_node")


def shape(params: Mapping[str, Any]) -> str:
    """'2 node(s) x 4 GPU(s)' (or 'x 3 CPU slot(s)' where gpus_per_node=0): the allocation asked for; on whole
    nodes, gpus_per_node is the least each brings."""
    gpus = params["gpus_per_node"]
    if whole_nodes(params):
        return f"{params['nodes']} whole node(s), each with all its GPUs (at least {gpus})"
    each = f"{gpus} GPU(s)" if gpus else f"{(params.get('pool') or {}).get('cpu_slots', 1)} CPU slot(s)"
    return f"{params['nodes']} node(s) x {each}"


def submit(params: Mapping[str, Any], argv: Sequence[str], sweep_dir: Path) -> dict:
    """The sweep's command line again, with gpu_pool, as one SLURM job (submit_command)."""
    return submit_command(params, [sys.executable, *inner_argv(argv, sweep_dir, inside(params))], sweep_dir,
                          sweep_dir / STATE)


def submit_command(params: Mapping[str, Any], command: Sequence[str], sweep_dir: Path, state: Path) -> dict:
    """Write the script that runs `command`, check the cluster, sbatch it; the job's record (also
    STATE/job.json)."""
    check(params)
    cluster.check_tools("hydra/launcher=slurm_pool", "hydra/launcher=gpu_pool")
    partition = cluster.check(params.get("partition"), float(params.get("ping_timeout_s") or 15.0))
    _say_whole_nodes_gpus(params, partition)
    state.mkdir(parents=True, exist_ok=True)
    script = state / "allocation.sbatch"
    atomic_write_bytes(script, sbatch_script({**params, "partition": partition}, command, Path.cwd(),
                                             state).encode())
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                              timeout=SLURM_CALL_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"sbatch did not answer within {SLURM_CALL_S:g} s: is the SLURM controller up?") from None
    if done.returncode != 0:
        raise UserError(f"sbatch refused the sweep's allocation: {(done.stderr or done.stdout).strip()[:300]} "
                        f"(its script: {script})")
    job_id = done.stdout.strip().split(";")[0]
    record = {"job_id": job_id, "script": str(script), "output": str(state / f"allocation-{job_id}.out"),
              "exit": str(state / f"exit-{job_id}"), "sweep_dir": str(sweep_dir), "submitted": time.time()}
    atomic_write_bytes(state / "job.json", json.dumps(record, indent=1).encode())
    return record


def _say_whole_nodes_gpus(params: Mapping[str, Any], partition: str) -> None:
    """Whole nodes (--exclusive) whose nodes have more GPUs than gpus_per_node: SLURM gives the allocation every
    one of them (held, and counted against the user's share), idle where it asked for none."""
    if params.get("cpus_per_node"):
        return
    asked = params["gpus_per_node"]
    gpus = cluster.most_gpus_per_node(partition, float(params.get("ping_timeout_s") or 15.0))
    if not gpus or gpus <= asked:
        return
    whole = f"gpus_per_node={asked} asks for whole nodes (--exclusive) of partition {partition}, whose nodes have up " \
            f"to {gpus} GPU(s): SLURM gives them all to the allocation"
    if asked:
        print(f"slurm_pool: {whole}, and the sweep runs its jobs on every one; give hydra.launcher.cpus_per_node to "
              f"hold only {asked} GPU(s) and that many CPUs a node", file=sys.stderr, flush=True)
    else:
        print(f"slurm_pool: warning: {whole}, idle; give hydra.launcher.cpus_per_node to ask for CPUs only",
              file=sys.stderr, flush=True)


def take_over(params: Mapping[str, Any], config, hydra_context, job_overrides: Sequence[Sequence[str]]) -> None:
    """The launcher's first launch() (or an optimizing sweeper's start): the whole sweep as one SLURM job, then
    this process ends with the sweep's exit code (SystemExit: Hydra's multirun does not go on here). Under
    expgpu's dry_run=true: the script and where the first jobs would run, nothing submitted. Only for a sweep
    started by its command line (started_by_command_line): the allocation runs it again."""
    from omegaconf import OmegaConf

    params = plain(params)
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    check(params)
    alloc, rows = planned(params, config, hydra_context, job_overrides)
    if OmegaConf.select(config, "dry_run", default=False) is True:
        state = sweep_dir / STATE
        command = [sys.executable, *inner_argv(sys.orig_argv[1:], sweep_dir, inside(params))]
        print(f"--- sbatch script of the sweep's allocation (dry run: nothing submitted) ---\n"
              f"{sbatch_script(params, command, Path.cwd(), state).rstrip()}\n---", flush=True)
        if job_overrides:
            print(first_jobs(alloc, rows, (params.get("pool") or {}).get("jobs_per_gpu") or 1, whole_nodes(params)),
                  flush=True)
        raise SystemExit(0)
    record = submit(params, sys.orig_argv[1:], sweep_dir)
    print(f"slurm_pool: the sweep is SLURM job {record['job_id']} ({shape(params)}); sweep dir {sweep_dir}; "
          f"its output: {record['output']}", flush=True)
    if params.get("detach"):
        print(f"slurm_pool: detached. Follow it: python -m expgpu.slurm.sweep_job {sweep_dir}; stop it: "
              f"scancel {record['job_id']}", flush=True)
        raise SystemExit(0)
    raise SystemExit(follow(record))


def refuse_live(sweep_dir: Path) -> None:
    """RunDirBusy where the sweep dir's allocation (STATE/job.json) is still in SLURM's queue, pending or
    running: a second allocation would run the same jobs into the same dirs. Its process runs on another
    node, where expgpu.status.busy cannot see it; SLURM can. A job that left the queue (ended, cancelled,
    timed out) or a queue that does not answer refuses nothing: a rerun resumes the sweep."""
    job = results.allocation_job(sweep_dir)
    if job is None:
        return
    try:
        state = state_of(job)
    except OSError:   # no squeue here: nothing to ask (submitting will say what is missing)
        return
    if state is None or state.startswith("UNKNOWN"):
        return
    raise RunDirBusy(f"hydra.sweep.dir={sweep_dir}: its sweep is SLURM job {job}, still {state}; two sweeps in one "
                     f"dir would overwrite each other's jobs and files: follow it (python -m expgpu.slurm.sweep_job "
                     f"{sweep_dir}), stop it (scancel {job}), or give this sweep another hydra.sweep.dir")


def plain(params: Mapping[str, Any]) -> dict:
    from omegaconf import OmegaConf

    return {k: (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v) for k, v in params.items()}


def started_by_command_line(config, argv: Sequence[str]) -> bool:
    """Whether this process's command line is the sweep's, for the allocation to run again (inner_argv). A sweep
    started another way (Hydra's compose API, a test runner or a notebook calling the launcher) has none: its
    jobs are sent themselves instead (expgpu.slurm.sweep_batch)."""
    from omegaconf import OmegaConf

    # as given: an override may hold an interpolation (hydra.sweep.subdir=d_${hydra.job.num}), not to resolve here
    nodes = [OmegaConf.select(config, key, default=None) for key in ("hydra.overrides.hydra", "hydra.overrides.task")]
    given = [str(o) for node in nodes if node is not None for o in OmegaConf.to_container(node, resolve=False)]
    # hydra.mode=MULTIRUN: what Hydra adds for -m
    return all(o in argv for o in given if o != "hydra.mode=MULTIRUN")


def planned(params: Mapping[str, Any], config, hydra_context, job_overrides: Sequence[Sequence[str]], first: int = 0):
    """(the allocation params ask for, [(num, label, GPUs, nodes)] of each job): every job composed and checked
    against that allocation now, before anything is submitted (a job that can never fit is one line, not a
    failure after the queue); the sweep's own config stands for the jobs an optimizing sweeper will ask for."""
    from expgpu.pool import jobs as jobfiles
    from expgpu.pool.allocation import Allocation, check_job, cpu_jobs, on_cpu_slots
    from expgpu.pool.settings import job_nodes, need_in_allocation, settings

    nodes = tuple(f"node{i + 1}" for i in range(params["nodes"]))
    gpus = tuple(range(params["gpus_per_node"]))
    alloc = Allocation("(to submit)", nodes, {n: gpus for n in nodes},
                       {n: params.get("cpus_per_node") or 1 for n in nodes}, None)
    s = settings(pool_params(inside(params)))
    if cpu_jobs(alloc, s):   # as gpu_pool will count it inside
        alloc = on_cpu_slots(alloc, s.cpu_slots)
    rows, tasks = [], []
    for num, overrides in enumerate(job_overrides or [()], first):
        cfg = (jobfiles.compose(hydra_context, config, overrides, num, lambda c: 0).config if job_overrides
               else _numbered(config, num))
        n, key = job_nodes(cfg, s)
        need = need_in_allocation(cfg, s, alloc, n)
        label = f"job #{num} ({' '.join(overrides)})" if job_overrides else "the sweep's jobs"
        check_job(label, need, n, alloc, key, "hydra.launcher.pool.gpus_per_job" if s.gpus_per_job is not None
                  else "launch.nproc_per_node x gpu_map.gpus_per_rank")
        rows.append((num, " ".join(overrides), need, n))
        tasks += _task_to_check(cfg, label)
    precheck.check(tasks, then="nothing was submitted")
    return alloc, rows


def _numbered(config, num: int):
    """The sweep's own config, standing for its jobs, with a job's number (its ${hydra:job.num} resolves)."""
    import copy

    from omegaconf import open_dict

    cfg = copy.deepcopy(config)
    with open_dict(cfg):
        cfg.hydra.job.num = num
    return cfg


def _task_to_check(cfg, label: str) -> list[tuple[str, dict]]:
    """[(label, the job's task config)] for an expgpu job of a task function or the built-in loop
    (expgpu.task.precheck's to check before the queue); [] for another Hydra app's job, or a script task,
    checked here as its start will check it (in the allocation, which runs from this launch dir)."""
    from expgpu import config
    from expgpu.pool.job_config import in_job, resolved
    from expgpu.script import spec

    if not config.is_expgpu(cfg):
        return []
    task = resolved(cfg, "task")
    if spec.is_script(task):
        in_job(cfg, lambda c: spec.checked(c, Path.cwd()))
        return []
    return [(label, task)]


def first_jobs(alloc, rows: list[tuple], jobs_per_gpu: int = 1, whole: bool = False, shown: int = 8) -> str:
    """Where the first jobs would run on the allocation (node names are SLURM's to choose); `whole`: on whole
    nodes, which may bring more GPUs than it was asked for."""
    from expgpu.pool import sharing
    from expgpu.pool.allocation import fit
    from expgpu.pool.scheduler import Scheduler

    rows = rows[:shown]
    nodes = {num: n for num, _, _, n in rows}
    placed = {num: slots for num, slots, _ in Scheduler(patience=1).pick(
        [(num, need) for num, _, need, _ in rows], sharing.shares(alloc.slots(), 1 if alloc.cpu else jobs_per_gpu),
        [], float("inf"), lambda free, num, need: fit(free, need, nodes[num]))}
    unit = "CPU slot" if alloc.cpu else "GPU"
    each = f", {jobs_per_gpu} jobs on each" if jobs_per_gpu > 1 and not alloc.cpu else ""
    more = "; whole nodes bring all their GPUs: where a node has more, more jobs start at once" if whole else ""
    out = [f"the first {len(rows)} job(s) on {len(alloc.nodes)} node(s) x {alloc.gpus_per_node} {unit}(s){each} "
           f"(SLURM names the nodes{more}):"]
    for num, label, _, _ in rows:
        where = placed.get(num)
        text = "; ".join(f"{node}: {unit} {','.join(str(g.index) for g in on)}{sharing.which(on)}"
                         for node in dict.fromkeys(g.node for g in where)
                         for on in [[g for g in where if g.node == node]]) if where else f"waits for {unit}s to free"
        out.append(f"  #{num} {label or '(no overrides)'} -> {text}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """python -m expgpu.slurm.sweep_job SWEEP_DIR: follow a slurm_pool sweep again."""
    args = sys.argv[1:] if argv is None else argv
    path = rundir.allocation_record(Path(args[0])) if args else None
    try:
        record = json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        record = None
    if record is None:
        print(f"expgpu: error: {args[0] if args else '(no SWEEP_DIR)'} holds no slurm_pool job "
              f"({STATE}/job.json); usage: python -m expgpu.slurm.sweep_job SWEEP_DIR", file=sys.stderr)
        raise SystemExit(2)
    if shutil.which("squeue") is None:
        print("expgpu: error: squeue is not on PATH: follow the job from a SLURM login node", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(follow(record))


if __name__ == "__main__":
    main()
