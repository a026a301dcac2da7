"""One rank, from "who am I" to result.json: the straight line of docs/architecture.md.

    ranks.detect() -> placement (inventory + strategy) -> gpus.apply -> task.resolve
        -> group.process_group -> Run -> fn(run, **params) -> result.json (rank 0)

A script task (task.script / task.module) leaves the line after placement: its rank starts the
script in a child process with the plan's GPU mask, and supervises it (expgpu.script.runner).

Started in-process by `python -m expgpu` (single process, torchrun, srun, mpirun), or
as `python -m expgpu.launch.worker RUN_DIR` by expgpu's own spawn, which hands down the
resolved config and the node plan in RUN_DIR/.expgpu/.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from expgpu import envvars, results, rundir
from expgpu.errors import UserError, timed_out
from expgpu.gpus import NodePlan, apply, placement
from expgpu.launch import failures, task_env
from expgpu.procs import stop_signals
from expgpu.ranks import RankInfo
from expgpu.rundir import atomic_write_bytes
from expgpu.train import watchdog
from expgpu.train.run_end import slow_data

log = logging.getLogger("expgpu")


def run_rank(cfg: dict, info: RankInfo, run_dir: Path, node: NodePlan | None = None,
        t_start: float | None = None, on_error=None) -> dict | None:
    """Train as this rank; returns the result dict on rank 0.

    `on_error(e, step)` hears of an error, and the steps the run had done, before the process group is torn
    down, which makes the other ranks fail too ("connection reset by peer"): whoever collects failures can
    tell cause from echo."""
    t_start = t_start or float(os.environ.get(envvars.START_TIME, time.time()))
    timeout = cfg["backend"]["timeout_s"]
    results.write_rank_node(run_dir, info.rank)   # under SLURM: which node a hang of this rank's is on
    if node is None:
        node = placement.shared(cfg, info, run_dir, timeout)
    if cfg.get("script") is not None:   # no torch in this process: the script's child imports it
        from expgpu.script import runner as script_runner

        return script_runner.run_rank(cfg, info, run_dir, node, t_start, _trial() if info.rank == 0 else None)
    device, my_gpus, host = _own_gpus(cfg, info, node)

    from expgpu import task as tasks
    from expgpu.distributed import group

    # A pinned rank ("inherited") knows only its own GPU; the launcher gave each rank one.
    node_gpus = ([[g.index for g in my_gpus]] if node.strategy == "inherited"
                 else [[g.index for g in a] for a in node.assignments])
    backend = group.choose_backend(cfg["backend"]["name"], node_gpus, cuda_available=device.type == "cuda")
    agreement = _agreement(cfg, info)
    spec = tasks.resolve(cfg["task"])   # imports the user's module: only now that this process owns its GPU
    with group.process_group(info, backend, timeout, run_dir, device):
        run = _run(cfg, info, run_dir, spec, agreement, device, node, my_gpus)
        base = {"task": spec.name, "function": spec.target, "task_config": cfg["task"], "source": info.source,
                # One rank makes no process group: there is no backend to report.
                "world_size": info.world_size, "backend": backend if info.world_size > 1 else None,
                "strategy": node.strategy, "run_dir": str(run_dir)}
        dog = watchdog.start(group.store(), info.rank, info.world_size, run_dir, watchdog.settings(cfg),
                             run.progress, lambda verdict, text: _hung(run, base, verdict, text, info),
                             lambda: _peer_failed(run))
        status, metrics = _outcome(run, spec, dog, on_error, t_start)
        mine = run.result(t_start, STEP_MEANS)
        me = {"rank": info.rank, "host": host, "device": str(device), "gpus": [g.index for g in my_gpus],
              "names": [g.name for g in my_gpus], "param_checksum": mine["param_checksum"],
              "weights_checksum": mine.pop("weights_checksum"), "data_wait": mine["timing"]["data_wait"],
              **_gpu_peak(device)}
        ranks = group.gather_objects(me, info.world_size)
    if info.rank != 0:
        return None
    checksums = [r["param_checksum"] for r in ranks]
    _warn_apart(ranks, cfg["launch"]["wrap"])
    slow = slow_data([r["data_wait"] for r in ranks], mine["timing"]["train_s"], *run.data_workers())
    if slow:
        log.warning("%s", slow)
    for r in ranks:
        r.pop("weights_checksum")
    return results.write_result(run_dir, {
        "status": status, **base, "plan": ranks, "metrics": metrics, **mine, "rank_checksums": checksums})


def _warn_apart(ranks: list[dict], wrap: str) -> None:
    """Rank 0, at the end: ranks whose parameters ended other than rank 0's. Under launch.wrap=none nothing keeps
    them in step (said for the whole state); else what DDP keeps in step is the parameters (the buffers it does
    not, BatchNorm's running stats after the last forward, it broadcasts from rank 0 at the next, as a resume
    gives rank 0's to all), so parameters apart mean gradients no wrapper synced."""
    key = "param_checksum" if wrap == "none" else "weights_checksum"
    sums = [r[key] for r in ranks]
    apart = [r for r, c in enumerate(sums) if c != sums[0]]
    if not apart or None in sums:
        return
    why = ("launch.wrap=none keeps no rank in step" if wrap == "none" else
           f"no gradient sync kept them in step (launch.wrap={wrap} syncs a module given to run.wrap, in the steps "
           f"whose loss comes from its forward, model(...))")
    log.warning("rank(s) %s ended with other parameters than rank 0 (result.json's rank_checksums): %s, and the "
                "checkpoint keeps rank 0's state, which a resume gives to every rank", ", ".join(map(str, apart)), why)


def _gpu_peak(device) -> dict:
    """This rank's peak GPU memory in MiB, for sizing a batch or packing jobs: what torch's caching allocator
    held at most (reserved: what the GPU had to have for it, beside the CUDA context) and what tensors used of
    it (allocated); nothing on the CPU. Read once, at the end: no cost while training."""
    if device.type != "cuda":
        return {}
    import torch

    return {"gpu_peak_reserved_mb": round(torch.cuda.max_memory_reserved(device) / 2**20),
            "gpu_peak_allocated_mb": round(torch.cuda.max_memory_allocated(device) / 2**20)}


def _own_gpus(cfg: dict, info: RankInfo, node: NodePlan):
    """This process's device, GPUs and host name, after masking it to its GPU(s)."""
    simulated = cfg["inventory"]["simulate"] is not None
    my_gpus = node.gpus_of(info.local_rank)
    # Before anything imports torch.cuda: this process must only ever see its GPU(s).
    # Simulated GPUs are planned and masked (what the pool tests observe), never used.
    isolation = "visible_devices" if simulated or cfg["launch"]["isolation"] == "auto" else cfg["launch"]["isolation"]
    device = apply(node, info.local_rank, isolation)
    import torch

    if simulated:
        device = torch.device("cpu")
    elif device.type == "cuda" and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        # A GPU node with torch's CPU wheel: NVML sees the GPUs, torch cannot use them ("Torch not compiled
        # with CUDA enabled" deep in the task's first .to(device))
        raise UserError(f"this node has GPUs (rank {info.rank} was planned GPU {my_gpus[0].index}: {my_gpus[0].name}), "
                        f"but this torch {torch.__version__} is a CPU-only build: install a CUDA build of torch "
                        "(EXPGPU_TORCH, docs/quick-start.md), or train on the CPU with CUDA_VISIBLE_DEVICES=''")
    host = socket.gethostname()
    log.info("rank %d/%d on %s -> %s%s", info.rank, info.world_size, host, device,
             f" (GPU {','.join(str(g.index) for g in my_gpus)}: {my_gpus[0].name})" if my_gpus else "")
    return device, my_gpus, host


def _outcome(run, spec, dog, on_error, t_start: float) -> tuple[str, dict]:
    """The task function called, its status and metrics; the loggers' runs ended either way."""
    try:
        status, metrics = _call(run, spec)
    except BaseException as e:
        if dog is not None and timed_out(e):   # it waited past backend.timeout_s: say for whom, not only that
            held = dog.held_up(e, run.cfg.backend.timeout_s)
            if held is not None:
                e.add_note(held)
        if on_error is not None:
            on_error(e, run.step)
        if dog is not None and not isinstance(e, KeyboardInterrupt):
            dog.done(failed=True)   # its peers stop now, not at the collective's timeout
        run.finish_loggers("failed", {})
        raise
    finally:
        if dog is not None:
            dog.done()
    if status == "stopped" and run.final_stop:   # final: not to resume
        status = "pruned" if run.pruned else "diverged"
    # The run's speed beside what it returned: the loggers' runs compare it across a sweep.
    speed = run.timings(t_start)["steps_per_s"]
    run.finish_loggers(status, {**metrics, **({"steps_per_s": speed} if speed is not None else {})})
    return status, metrics


def _agreement(cfg: dict, info: RankInfo):
    """The ranks' stop agreement on this process's stop signals."""
    from expgpu.train.agreement import StopAgreement

    # Installed already by the CLI entry or main() below (a signal during startup is kept);
    # here when a launcher calls the task function itself. Left installed: a signal that
    # lands after training (SLURM's own SIGTERM after a requeue) must not kill the exit path.
    poll = cfg["checkpoint"]["poll_every"]
    return StopAgreement(stop_signals.install(), world_size=info.world_size,
                         poll_every=None if poll == "auto" else poll,
                         # checkpoint.verify's stop, at the same step on every rank
                         stop_at=int(os.environ.get(envvars.STOP_AT) or stop_signals.NEVER))


def _run(cfg: dict, info: RankInfo, run_dir: Path, spec, agreement, device, node, my_gpus):
    from expgpu.train import proportional
    from expgpu.train.run import Run

    return Run(info=info, device=device, run_dir=run_dir, cfg=cfg, spec=spec, agreement=agreement,
               wrap=cfg["launch"]["wrap"], n_gpus=len(my_gpus),
               gpu_speed=proportional.gpu_speed(node.scores, my_gpus, ranked=node.strategy == "ranked"),
               sinks=_sinks(cfg, run_dir) if info.rank == 0 else ())


def _peer_failed(run) -> None:
    """Before the watchdog ends this rank for a peer's failure or a hang (os._exit, no exception path): its
    metrics rows to the OS, and its loggers' runs ended as failed (an MLflow run would stay RUNNING for ever)."""
    run.write_out_rows()
    run.finish_loggers("failed", {})


def _hung(run, base: dict, verdict: dict, text: str, info: RankInfo) -> None:
    """The rank that claimed a hang's verdict: what was said, and result.json ("hung"), before every rank
    exits (expgpu.train.watchdog). Under expgpu's spawn its supervisor prints the line; else this rank."""
    run_dir = Path(base["run_dir"])
    rundir.hang_dir(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(rundir.hang_verdict(run_dir), (json.dumps(verdict, indent=2) + "\n").encode())
    results.write_result(run_dir, {
        "status": "hung", **base, "plan": [], "metrics": {}, "steps": min(v["step"] for v in verdict["ranks"].values()),
        "max_steps": run.max_steps, "epochs": None, "length_keys": run.length_keys, "step_means": STEP_MEANS,
        "resumed_from_step": run.resumed_from_step, "stop_signal": None, "timing": {}, "param_checksum": None,
        "rank_checksums": [], "hang": verdict})
    log.error("hang: %s (every rank's stacks: %s)", text, rundir.hang_dir(run_dir))
    if info.source != "local":   # no supervisor of expgpu's to say it
        print(f"expgpu: hung: {text} (every rank's stacks: {rundir.hang_dir(run_dir)})", file=sys.stderr, flush=True)


STEP_MEANS = "one iteration of run.steps on every rank"


def _sinks(cfg: dict, run_dir: Path) -> list:
    """Where rank 0's rows go besides metrics.jsonl: the chosen loggers and, when an optimizing sweeper
    started this job as a trial, the study (its pruner judges them)."""
    from expgpu import loggers

    return [s for s in (loggers.build(cfg, run_dir), _trial()) if s is not None]


def _trial():
    """The study's reporter, when an optimizing sweeper started this job as a trial whose pruner judges its rows
    (a function's run.log, a script's expgpu.log); a run that is no trial never imports the bridge."""
    from expgpu.tune import TRIAL_ENV

    if not os.environ.get(TRIAL_ENV):
        return None
    from expgpu.tune.bridge import attached

    return attached()


def _call(run, spec) -> tuple[str, dict]:
    """fn(run, **params) -> ("finished", its metrics) or ("stopped", {}) after a stop signal."""
    from expgpu import task as tasks
    from expgpu.train.run import StopTraining

    params = tasks.build_params(spec)
    finished = False
    try:
        with task_env.torchrun_variables(run), task_env.stdout_of(run):
            try:
                returned = spec.fn(run, **params)
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
                # sys.exit(0) in the task: its end, as a return (a process that just ended would leave no
                # result.json, and on several ranks its peers blamed for the collective it left)
                log.info("rank %d: the task called sys.exit(%s): taken as its end", run.rank,
                         e.code if e.code is not None else "")
                returned = None
        finished = True
    except StopTraining:
        return "stopped", {}
    finally:
        run.close(finished)
    return "finished", _metrics(returned, spec.target)


def _metrics(returned, target: str) -> dict:
    """A task function's return value as result.json's metrics: a dict of numbers, or nothing."""
    from collections.abc import Mapping

    if returned is None:
        return {}
    if not isinstance(returned, Mapping):
        raise UserError(f"{target} returned a {type(returned).__name__}; return a dict of numbers "
                        "(result.json's metrics) or None")
    out = {}
    for key, value in returned.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if value is not None and not isinstance(value, (int, float)):   # bool is an int
            raise UserError(f"{target} returned {key}={value!r}; metrics are numbers (or None)")
        out[str(key)] = value
    return out


def setup_logging(run_dir: Path, rank: int) -> None:
    """The logging the user chose with hydra/job_logging (default, stdout, disabled, ...), as in the
    process that spawned this one, with "[rank N]" before each message when there are several
    ranks; also logs/rank<N>.log (not under hydra/job_logging=disabled, which disables expgpu's
    logger itself)."""
    import logging.config

    make_record = logging.getLogRecordFactory()

    def tagged(*args, **kwargs):
        record = make_record(*args, **kwargs)
        if isinstance(record.msg, str):
            record.msg = f"[rank {rank}] {record.msg}"
        return record

    if os.environ.get(envvars.WORLD_SIZE, "1") != "1":   # one rank's lines are all its own
        logging.setLogRecordFactory(tagged)
    try:
        chosen = json.loads(rundir.logging_file(run_dir).read_text())
    except (OSError, ValueError):
        chosen = None   # hydra/job_logging=none, or a run dir of an older expgpu
    root = logging.getLogger()
    if chosen:
        logging.config.dictConfig(chosen)
    else:
        root.setLevel(logging.INFO)
    log_file = rundir.rank_log(run_dir, rank)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(log_file)
    file.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
    root.addHandler(file)


def main() -> None:
    """Entry of a worker started by expgpu.launch.spawn (never by users)."""
    from expgpu import ranks
    from expgpu.procs import stop_signals

    stop_signals.install()  # first: spawn started this process with stop signals held until now
    # A rank killed inside C++ (SIGSEGV, SIGABRT from gloo/NCCL/CUDA) prints where Python was,
    # in every thread, instead of only the supervisor's "killed by SIGABRT".
    faulthandler.enable(all_threads=True)

    from expgpu.errors import EXIT_PEER_FAILED, EXIT_USER_ERROR, UserError, WorkerFailed, lost_peer, no_room

    run_dir = Path(sys.argv[1])
    rank = int(os.environ.get(envvars.RANK, "0"))
    setup_logging(run_dir, rank)
    try:
        info = ranks.detect()
        cfg = json.loads(rundir.config_file(run_dir).read_text())
        node = NodePlan.from_dict(json.loads((run_dir / rundir.PLAN).read_text())["node"])
        run_rank(cfg, info, run_dir, node, on_error=lambda e, step: failures.record(run_dir, rank, e, step))
    except UserError as e:
        # The supervisor prints it, once: every rank may hit the same bad input (a checkpoint
        # of another world size), and the user should read one line, not one per rank.
        failures.record(run_dir, rank, e)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt as e:
        failures.record(run_dir, rank, e)
        sys.exit(130)
    except WorkerFailed as e:   # a script task's rank: its message names the script's exit, no traceback
        failures.record(run_dir, rank, e)
        sys.exit(1)
    except BaseException as e:
        failed = failures.failed_before(run_dir, rank)
        failures.record(run_dir, rank, e)
        if not isinstance(e, SystemExit) and lost_peer(e):
            failed = failures.lost_to(run_dir, rank, failed)
        if failed and not isinstance(e, SystemExit):
            # An echo (a collective torn down by a peer's end): the peer's traceback says why, the supervisor's
            # line names it; eight ranks' echoes would bury it.
            log.error("rank %d: stopping: rank(s) %s failed (their error is their own record)", rank,
                      ", ".join(map(str, failed)))
            sys.exit(EXIT_PEER_FAILED)
        if no_room(e):   # a full disk: the supervisor's line names the file, a traceback adds nothing
            sys.exit(1)
        raise
    # Everything this rank writes is on disk (atomic writes, closed files); skip interpreter
    # shutdown, during which a gloo thread still alive past destroy_process_group can abort
    # the process (group._let_gloo_threads_finish says why), but run the user's atexit handlers.
    from expgpu import procs

    procs.fast_exit(0)


if __name__ == "__main__":
    main()
