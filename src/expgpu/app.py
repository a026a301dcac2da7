"""What `python -m expgpu` does with a composed config: plan, then train here or spawn.

Three cases, decided by who started this process and by launch.nproc_per_node:
- dry_run: print the node plan and each rank's memory for parameters and optimizer state
  (expgpu.gpus.memory_estimate, counted in a child process), write plan.json, stop (no torch, no CUDA);
- nproc_per_node > 1: this process is only a supervisor: it plans the node once and
  starts the workers (expgpu.launch.spawn), one per local rank;
- otherwise this process is a rank itself (alone, or one of torchrun's/srun's).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from contextlib import nullcontext
from pathlib import Path

from omegaconf import DictConfig

from expgpu import config, envvars, loggers, procs, ranks, rundir, script
from expgpu.checkpoint import verify
from expgpu.errors import Hung, PeerLost, RunDirBusy, Stopped, UserError, WorkerFailed, first_line, lost_peer
from expgpu.gpus import memory_estimate, placement
from expgpu.launch import failures, requeue, restarts, run_leases, spawn, worker
from expgpu.procs import stop_signals
from expgpu.results import CUT_SHORT, finished_earlier, is_script, nonfinite_words, write_job_failure
from expgpu.rundir import atomic_write_bytes
from expgpu.status.busy import claim, refuse_busy
from expgpu.task import precheck

log = logging.getLogger("expgpu")


def _task_name(cfg: dict) -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get("task") or "task"


def _job_logging() -> dict | None:
    """hydra.job_logging as this process applied it (None for hydra/job_logging=none)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    chosen = OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True)
    return chosen or None


def _launch_dir() -> str:
    """Where the user launched from (Hydra's original cwd; the same in a SLURM job or a pool's job)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return str(HydraConfig.get().runtime.cwd)
    except ValueError:   # no Hydra job: called directly
        return os.getcwd()


def _write_plan(run_dir: Path, node, info: ranks.RankInfo, extra: dict | None = None) -> list[dict]:
    rows = placement.rows(node, placement.node_ranks(info, len(node.assignments)))
    doc = {"host": socket.gethostname(), "strategy": node.strategy, "ranks": rows,
           "node": node.to_dict(), **(extra or {})}
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / rundir.PLAN, (json.dumps(doc, indent=2) + "\n").encode())
    return rows


# Errors whose own line already says what happened (a supervisor's "rank N failed: ...", a hang's verdict):
# recorded as they are, never taken for a lost peer's echo.
_SAID = (UserError, WorkerFailed, Hung)


def run(cfg: DictConfig, run_dir: Path) -> dict | None:
    """Train as the config says (see the module's docstring); a failure leaves its one-line reason
    in the run dir (.expgpu/failure.json), where the report reads it under any launcher."""
    try:
        return _run(cfg, run_dir)
    except (Stopped, KeyboardInterrupt):
        raise
    except BaseException as e:
        _record_failure(run_dir, e)
        rank = None if isinstance(e, _SAID) else _rank_of_several()
        echo = failures.echo_of(run_dir, rank, e) if rank is not None and run_dir.is_dir() else None
        if echo is not None:   # a peer's end torn this rank's collective: one line naming it, not a traceback
            raise PeerLost(echo) from None
        raise


def _record_failure(run_dir: Path, e: BaseException, step: int | None = None) -> None:
    """The job's failure, once: the first is the cause (under srun every rank records it; the others echo
    it). A config error before the run dir exists leaves nothing behind. `step`: the steps the failing rank's
    run had done, which a restart compares (expgpu.launch.restarts)."""
    if isinstance(e, (Stopped, KeyboardInterrupt, SystemExit, RunDirBusy)) or not run_dir.is_dir() or \
            rundir.job_failure_file(run_dir).exists():
        return
    said = isinstance(e, _SAID)
    # a rank's own error (an srun task's): which rank, for the restart's line
    rank = None if said else _rank_of_several()
    try:
        write_job_failure(run_dir, str(e) if said else f"{type(e).__name__}: {first_line(e)}",
                          isinstance(e, UserError), rank=rank, step=step, lost_peer=not said and lost_peer(e))
    except OSError:   # a full disk: the record is lost, not the error it records (raised on by the caller)
        pass


def _rank_of_several() -> int | None:
    """This process's rank where it is one of several (an srun task, a torchrun worker), else None."""
    try:
        info = ranks.detect()
    except UserError:
        return None
    return info.rank if info.world_size > 1 else None


def _check_nodes(nodes: int, info: ranks.RankInfo) -> None:
    """launch.nodes places a gpu_pool job inside a SLURM allocation (its srun step has that many nodes);
    anywhere else a run's nodes are its launcher's, and a value other than theirs would be silently ignored."""
    have = info.num_nodes or -(-info.world_size // max(1, info.local_world_size))
    if nodes != 1 and nodes != have:
        raise UserError(f"launch.nodes={nodes} is not allowed here: it spreads a hydra/launcher=gpu_pool job over "
                        f"that many nodes of a SLURM allocation, and this run has {have} node(s) ({info.source}); "
                        "elsewhere the nodes are the launcher's (srun/sbatch -N, hydra.launcher.nodes): leave it 1")


def _run(cfg: DictConfig, run_dir: Path) -> dict | None:
    stop_signals.install()  # here for launchers that call the task function (submitit); idempotent
    config.check(cfg)
    procs.user_threads()   # a thread count OpenMP would refuse: one line now
    plain = config.plain(cfg)
    if not plain["dry_run"]:
        loggers.check(plain)   # a logger's package missing: one line now, not a traceback in rank 0
    if not plain["task"].get("name"):
        plain["task"]["name"] = _task_name(plain)
    script.prepare(plain, _launch_dir())   # a script task: its keys checked, its command made (plain["script"])
    info = ranks.detect()
    _check_nodes(plain["launch"]["nodes"], info)
    nproc = plain["launch"]["nproc_per_node"]
    if nproc > 1 and info.local_world_size > 1:
        raise UserError(f"launch.nproc_per_node={nproc}, but {info.source} already started "
                        f"{info.local_world_size} processes on this node; let one launcher start "
                        "them: launch.nproc_per_node=1 under torchrun/srun/mpirun")
    local_ranks = nproc if nproc > 1 else info.local_world_size
    world = local_ranks * info.world_size if nproc > 1 else info.world_size
    config.check_world(plain, world)

    if info.rank == 0:
        refuse_busy(run_dir)   # before anything here reads or writes what another live run keeps there
    earlier = None if plain["dry_run"] else finished_earlier(run_dir, plain)
    if earlier is not None:
        if info.rank == 0:
            keys = earlier.get("length_keys", ["max_steps"])   # an older result.json: the built-in loop's
            longer = (f", a larger {' or '.join(f'task.{k}' for k in keys)} trains on" if keys else
                      "; other task.args run the script again there, with its resume_args" if is_script(earlier)
                      else "; its loop's length is no task parameter, so it cannot be trained on")
            done = "its script exited 0" if is_script(earlier) else f"{earlier['steps']} steps"
            print(f"expgpu: {run_dir} already holds this task's finished run ({done}); "
                  f"kept its result.json. checkpoint.resume=false trains it again from scratch{longer}",
                  file=sys.stderr, flush=True)
        return earlier if info.rank == 0 else None

    if plain["dry_run"]:
        node = placement.compute(plain, local_ranks)
        return _dry_run(plain, node, info, world, run_dir) if info.local_rank == 0 else None

    # started by hand on this machine: its GPUs leased, as a gpu_pool job's, so that no sweep takes them
    with run_leases.held(plain, local_ranks, run_dir) if run_leases.applies(plain, info) else nullcontext():
        if info.rank == 0:
            claim(run_dir)   # running, while this process lives (expgpu status); a second live run refused
            rundir.job_failure_file(run_dir).unlink(missing_ok=True)   # from an attempt this one reruns
            if loggers.chosen(plain):
                loggers.record_job(run_dir)   # the sweep and overrides, which only this process knows
        if plain["checkpoint"]["verify"]:
            return _finished(verify.verify(plain, info, run_dir, lambda cfg, where: _train(cfg, info, where, nproc)),
                             info, run_dir)
        return _finished(_train(plain, info, run_dir, nproc), info, run_dir)


def _dry_run(plain: dict, node, info: ranks.RankInfo, world: int, run_dir: Path) -> dict:
    """dry_run=true, on a node's first process: the task checked as its ranks would check it, the plan printed
    and written (plan.json), what each rank holds for parameters and optimizer state; nothing trained."""
    from concurrent.futures import ThreadPoolExecutor

    # the check and the memory count each import torch in a child process (the built-in loop): side by side
    with ThreadPoolExecutor(1) as side:
        memory = side.submit(memory_estimate.measure, plain["task"])
        if plain.get("script") is None:   # a script's keys were checked as it was prepared
            precheck.check([("", plain["task"])])
        rows = _write_plan(run_dir, node, info)
        print(placement.table(rows, node.strategy), flush=True)
        if plain.get("script") is not None:
            from expgpu.script import runner as script_runner

            print(script_runner.dry_run(plain, node, [r["rank"] for r in rows], run_dir), flush=True)
        print(memory_estimate.line(memory.result(), world), flush=True)
    if run_leases.applies(plain, info):   # the run itself would plan around GPUs leased now
        print(run_leases.preview(node) or "", end="", flush=True)
    print(f"plan written to {run_dir / rundir.PLAN} (dry run: nothing trained)", flush=True)
    return {"status": "dry_run", "plan": rows}


def _train(plain: dict, info: ranks.RankInfo, run_dir: Path, nproc: int) -> dict | None:
    """Train in `run_dir`, here (one process per rank) or in nproc workers; rank 0's result."""
    script_task = plain.get("script")
    # A warm server (EXPGPU_WARM_SERVER) may fork the ranks of a launch started here by hand, not
    # those of torchrun, mpirun or a SLURM job (its steps, or a bare sbatch script): they stay in the
    # processes, cgroup and node those gave them. A process warm already (a gpu_pool job's) trains
    # its one rank itself.
    shared = (info.source == "single" and "SLURM_JOB_ID" not in os.environ
              and (nproc > 1 or "torch" not in sys.modules))
    server = spawn.rank_server(warm=not script_task, nproc=nproc, shared=shared)
    # One rank trains in this process, unless it may have to start again (launch.max_restarts): a rank of
    # its own then, which this process supervises, as torchrun's agent does.
    alone = not (plain["launch"]["max_restarts"] and info.source == "single" and restarts.in_charge(1))
    if nproc == 1 and server is None and alone:
        # its error recorded before its process group goes (the others' echo would come first)
        return worker.run_rank(plain, info, run_dir, on_error=lambda e, step: _record_failure(run_dir, e, step))
    # Else this process supervises: one rank forked by a warm server (this process then never
    # imports torch), or several.
    try:
        return _supervise(plain, info, run_dir, nproc, server)
    finally:
        if server is not None:
            server.close()


def _supervise(plain: dict, info: ranks.RankInfo, run_dir: Path, nproc: int, server) -> dict | None:
    """Start the node's ranks and wait for them: one plan for the node, written where they read it."""
    node = placement.compute(plain, nproc)
    _write_plan(run_dir, node, info)
    rundir.state_dir(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(rundir.config_file(run_dir), json.dumps(plain).encode())
    atomic_write_bytes(rundir.logging_file(run_dir), json.dumps(_job_logging()).encode())
    multi_node = info.world_size > 1  # one supervisor per node (e.g. srun --ntasks-per-node=1)
    script_task = plain.get("script")
    # a stopped rank's script has its grace period; then its rank writes how it ended
    grace = script_task["grace_s"] + spawn.GRACE_S if script_task else spawn.GRACE_S

    def attempt(n: int, cfg: dict):   # the node's ranks, once; a crash or hang may start them again
        if cfg is not plain:   # a restart's (expgpu.launch.restarts.resuming)
            atomic_write_bytes(rundir.config_file(run_dir), json.dumps(cfg).encode())
        # A script creates its process group itself, from MASTER_PORT: chosen here, before its ranks start
        # (a function task's rank 0 binds one and publishes it, expgpu.distributed.group)
        port = info.master_port if multi_node else spawn.free_port() if script_task else 0
        return spawn.run_node(nproc, run_dir, env_extra={envvars.ATTEMPT: str(n)}, node_rank=info.rank,
                              nnodes=info.world_size, master_addr=info.master_addr if multi_node else "127.0.0.1",
                              master_port=port, grace_s=grace, server=server)

    restarts.supervise(run_dir, plain, attempt, info.world_size)
    return json.loads((run_dir / rundir.RESULT).read_text()) if info.rank == 0 else None


def _finished(result: dict | None, info: ranks.RankInfo, run_dir: Path) -> dict | None:
    """rank 0's result (None elsewhere) -> returned, or a stop handed on (requeue, exit code)."""
    stopper = stop_signals.install()
    if result is not None and result["status"] == "stopped":
        stopper.agreed = result["stop_signal"]  # a supervisor learns it from its workers
    if stopper.agreed in stop_signals.FINAL_REQUESTS or (result or {}).get("status") in CUT_SHORT:
        # the trial's pruner, or a diverged loss, ended it: the job is done (no requeue), and a sweeper reads
        # why. The request is spent: a launcher that runs the next job in this process (basic) starts afresh.
        stopper.received = stopper.agreed = None
        if result is not None:
            where = Path(result["run_dir"]) / rundir.RESULT
            if result["status"] == "pruned":
                log.info("pruned at step %d by the study's pruner: %s", result["steps"], where)
            else:
                log.info("diverged: stopped at step %d (task.on_nonfinite=stop; %s): %s", result["steps"],
                         nonfinite_words(result.get("nonfinite")), where)
        return result
    if stopper.agreed:  # stopped on a signal, checkpoint saved by all ranks
        next_step = requeue.after_stop(stopper, info.rank, run_dir)
        if result is None:
            # Not rank 0: a clean exit, as rank 0 still reports (and may requeue); a non-zero
            # code would make `srun --kill-on-bad-exit` kill rank 0 before it has.
            return None
        raise Stopped(result, stopper.exit_code, next_step)
    if result is None:
        return None
    devices = sorted({r["device"] for r in result["plan"]})
    steps = f"{result['steps']} steps" if "command" not in result else "its script exited 0"
    log.info("done: task %s, %s on %d rank(s) (%s, %s%s): %s -> %s", result["task"], steps,
             result["world_size"], ",".join(devices),
             result["backend"] or ("the script's process group" if is_script(result) and result["world_size"] > 1
                                   else "no process group"),
             gpu_peak(result["plan"]), describe(result["metrics"]), Path(result["run_dir"]) / rundir.RESULT)
    return result


def gpu_peak(plan: list) -> str:
    """`; GPU memory peak 12.3 GiB` (the most of any rank), where the ranks trained on GPUs."""
    peaks = [r["gpu_peak_reserved_mb"] for r in plan if isinstance(r, dict) and r.get("gpu_peak_reserved_mb")]
    return f"; GPU memory peak {max(peaks) / 1024:.1f} GiB" if peaks else ""


def describe(metrics: dict) -> str:
    shown = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items() if v is not None]
    return ", ".join(shown) or "no metrics"
