"""One rank of a script task, from this node's GPU plan to the script's end (launch.worker.run_rank hands
over here).

    resume or not -> inputs linked into the run dir -> the child's environment -> the script, supervised
    (and watched for hangs, expgpu.script.watch) -> how it ended (every rank's record) -> rank 0: result.json,
    the loggers' outcome; after a hang, the rank that claimed it: result.json (hung), and every rank exits 124

Resume: a rerun in a run dir where the script ran before (an earlier attempt's result.json: a stop, a
requeue, a crash, or a finished run rerun with other args) adds task.resume_args, and with
task.resume_if only when that file exists in the run dir; checkpoint.resume=false never adds them. Every
rank decides alike from files this launch does not write before its scripts end.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
from pathlib import Path

from expgpu import procs, rundir
from expgpu.errors import EXIT_HUNG, Hung, UserError, WorkerFailed
from expgpu.gpus import NodePlan, placement
from expgpu.gpus.mask import gpu_env
from expgpu.procs import oom, stop_signals
from expgpu.ranks import RankInfo
from expgpu.script import environ, process, prune, result
from expgpu.script.loggers import LoggerFeed
from expgpu.script.spec import ScriptSpec
from expgpu.script.watch import Watch

log = logging.getLogger("expgpu")


def run_rank(cfg: dict, info: RankInfo, run_dir: Path, node: NodePlan, t_start: float, trial=None) -> dict | None:
    """Run this rank's script; rank 0's result (None elsewhere). A failed rank raises WorkerFailed, on
    that rank and on rank 0; a stop returns (status stopped) with the stopper's `agreed` signal set.
    `trial`: on rank 0 of a trial whose sweeper prunes, the study's reporter (expgpu.script.prune)."""
    spec = ScriptSpec.from_dict(cfg["script"])
    stopper = stop_signals.install()
    previous = result.previous(run_dir)
    resumed = _resumes(spec, cfg, run_dir, previous)
    attempt = 0 if previous is None else int(previous.get("attempt", 0)) + 1
    isolation = _isolation(cfg)
    _link_inputs(spec, run_dir)
    launch = attempt_id(info)
    env = environ.child_env(os.environ, info, node, isolation, run_dir=run_dir, launch_dir=spec.launch_dir,
                            module=spec.module, run_id=launch, restarts=attempt, resumed=resumed,
                            prompt=trial.key if trial is not None else None)
    argv = spec.argv(resumed)
    script_log = rundir.script_log(run_dir, info.rank)
    watch = Watch.of(cfg, spec.output_timeout_s, info.rank, info.world_size, run_dir, launch, script_log)
    if watch is not None:
        env.update(watch.env())
    mine = node.gpus_of(info.local_rank)
    log.info("rank %d/%d on %s: %s (CUDA_VISIBLE_DEVICES=%s%s)%s", info.rank, info.world_size, socket.gethostname(),
             shlex.join(argv[1:]), env.get("CUDA_VISIBLE_DEVICES") or "(none)",
             f"; its GPU {','.join(str(g.index) for g in mine)}: {mine[0].name}" if mine else "",
             _rerun(spec, resumed))
    feed = None
    if info.rank == 0:
        rundir.script_log_marker(run_dir).unlink(missing_ok=True)   # the rows of this attempt start anew
        feed = LoggerFeed(cfg, run_dir, trial)   # the loggers (a trial's pruner), the script's progress on the console
    oom_count = oom.OomCount()   # this process's cgroup, its script's
    try:
        outcome = process.run_script(argv, env, run_dir, script_log, stopper, spec.grace_s,
                                     _on_tick(feed, info, run_dir, launch, stopper), watch,
                                     console_stdout=info.rank == 0 or cfg["launch"]["stdout"] != "rank0")
        if outcome.stopped_by is None and outcome.exit_code not in (0, None) and prune.is_trial() \
                and prune.pruned(run_dir, launch):
            outcome.stopped_by = stop_signals.PRUNED   # rank 0's script, stopped first, broke its collective
        process.await_requeue(outcome, stopper)   # a preemption under submitit: SIGTERM, then SIGUSR2
        if watch is not None and not outcome.hung:
            watch.done()
    finally:
        if watch is not None:
            watch.close()
    device = "cuda" if mine and cfg["inventory"]["simulate"] is None else "cpu"
    record = result.write_record(run_dir, info, launch, outcome, [g.index for g in mine], [g.name for g in mine],
                                 device, oom_count)
    if outcome.hung:
        _hung(watch, feed, info, run_dir, launch, record,
              lambda records, verdict: result.write(cfg, info, node, run_dir, spec, records, argv, resumed, attempt,
                                                    t_start, outcome, hang=verdict))
    if outcome.stopped_by:
        stopper.agreed = outcome.stopped_by   # the exit code and the requeue follow it (app._finished)
    doc = None
    if info.rank == 0:
        records = result.collect(run_dir, info.world_size, launch, record)
        if watch is not None and any(r is not None and r.get("hung") for r in records):
            # a peer's script hung: the rank that claimed the hang writes result.json, then the verdict
            watch.wait_for_verdict()
            if feed is not None:
                feed.finish("failed", {}, None)
            return None
        doc = result.write(cfg, info, node, run_dir, spec, records, argv, resumed, attempt, t_start, outcome)
        if feed is not None:
            feed.finish(doc["status"], doc["metrics"], doc["steps"])
        failed = result.first_failure(records)
        if failed is not None:
            _raise(result.failure(failed, run_dir, spec, argv[len(spec.command):], records))
    elif result.failed(record):
        _raise(result.failure(record, run_dir, spec, argv[len(spec.command):]))
    return doc


def _on_tick(feed: LoggerFeed | None, info: RankInfo, run_dir: Path, launch: str, stopper):
    """What a rank's supervisor does each tick besides watching: rank 0 feeds the loggers and a trial's pruner,
    whose prune it announces to the other ranks before its script is stopped; another rank of a trial looks for
    that prune (expgpu.script.prune)."""
    peers = prune.is_trial() and info.world_size > 1
    if feed is None:
        return prune.PeerPrune(run_dir, launch, stopper).poll if peers else None
    if not peers:
        return feed.poll

    def tick() -> None:
        feed.poll()
        if stopper.received == stop_signals.PRUNED and not prune.pruned(run_dir, launch):
            prune.announce(run_dir, launch)
    return tick


def _raise(failure) -> None:
    """A rank's failure as the launch reports it: a user error (the script refused task.args) ends it with exit 2."""
    if failure.user_error:
        raise UserError(failure.message)
    raise WorkerFailed(failure)


def _hung(watch: Watch, feed, info: RankInfo, run_dir: Path, launch: str, record: dict, write) -> None:
    """After the watch stopped a hung script: the rank that claimed the hang writes the verdict (result.json with
    status hung, then RUN_DIR/hang/verdict.json, which the others wait for); every rank exits with EXIT_HUNG.
    Under expgpu's spawn its supervisor says the line; elsewhere (one process, torchrun, srun) the claimer
    raises Hung, which says it, and the others leave quietly."""
    if feed is not None:
        feed.finish("failed", {}, None)
    if not watch.claimed:
        watch.wait_for_verdict()
        procs.fast_exit(EXIT_HUNG)
    verdict = watch.conclude()
    write(result.collect(run_dir, info.world_size, launch, record), verdict)
    watch.write_verdict(verdict)
    log.error("hang: %s (every rank's stacks: %s)", verdict["line"], rundir.hang_dir(run_dir))
    if info.source == "local":
        procs.fast_exit(EXIT_HUNG)
    raise Hung(verdict["line"], str(rundir.hang_dir(run_dir)))


def _isolation(cfg: dict) -> str:
    """auto, unless each rank is to see only its own GPU(s) (set_device is refused in spec.prepare)."""
    return "visible_devices" if cfg["launch"]["isolation"] == "visible_devices" else "auto"


def _resumes(spec: ScriptSpec, cfg: dict, run_dir: Path, previous: dict | None) -> bool:
    if previous is None or not cfg["checkpoint"]["resume"]:
        return False
    return spec.resume_if is None or (Path(run_dir) / spec.resume_if).exists()


def attempt_id(info: RankInfo) -> str:
    """What the ranks of this launch share and a later launch does not: their records are matched by it."""
    launch = placement.launch_id(os.environ)
    if launch is not None and launch.startswith("torchrun-none-"):
        # torchrun without --rdzv-id gives every launch the run id "none"; its agent, the parent of all
        # its local workers, tells launches apart
        import psutil

        parent = psutil.Process(os.getppid())
        launch = f"{launch}-{parent.pid}-{parent.create_time():.0f}"
    return launch or f"{info.source}-{os.getpid()}"


def _link_inputs(spec: ScriptSpec, run_dir: Path) -> None:
    """task.inputs, linked into the run dir at the same relative path (every rank: a rank's script may
    read them before rank 0 gets here; replacing a link is atomic, so ranks doing it at once agree)."""
    for name, source in spec.inputs:
        link = Path(run_dir) / name
        if link.is_symlink() and os.readlink(link) == source:
            continue
        if link.exists() or link.is_symlink():
            raise UserError(f"task.inputs: {link} exists and is not a link to {source}; move it away (inputs are "
                            "linked into the run dir at the path they have under the launch dir)")
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{link.name}.link{os.getpid()}")
        tmp.unlink(missing_ok=True)
        os.symlink(source, tmp)
        os.replace(tmp, link)


def dry_run(cfg: dict, node: NodePlan, labels, run_dir: Path) -> str:
    """What each local rank would run (the dry run): its GPU mask and command line, in the run dir."""
    spec = ScriptSpec.from_dict(cfg["script"])
    resumed = _resumes(spec, cfg, run_dir, result.previous(run_dir))
    head = f"each rank runs, in {run_dir}{_rerun(spec, resumed)}:"
    return "\n".join([head, *commands(spec, cfg, node, labels, resumed)])


def _rerun(spec: ScriptSpec, resumed: bool) -> str:
    if not resumed:
        return ""
    return " (a rerun, with resume_args)" if spec.resume_args != spec.args else " (a rerun)"


def commands(spec: ScriptSpec, cfg: dict, node: NodePlan, labels, resumed: bool = False) -> list[str]:
    """A line per local rank (`labels`: their global ranks, None where unknown): its GPU mask and command."""
    isolation = _isolation(cfg)
    command = shlex.join(spec.argv(resumed))
    lines = []
    for local_rank, rank in enumerate(labels):
        gpus = environ.visible_gpus(node, local_rank, isolation)
        mask = gpu_env(gpus, os.environ.get("CUDA_DEVICE_ORDER"))["CUDA_VISIBLE_DEVICES"]
        lines.append(f"rank {'?' if rank is None else rank}: CUDA_VISIBLE_DEVICES={mask or '(none)'} {command}")
    return lines
