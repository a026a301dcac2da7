"""One run directory per run, shared by all of its ranks.

Hydra's default `outputs/${now:...}` is evaluated in each process: two srun tasks
started a second apart would write to two directories, and a requeued SLURM job
would start a fresh one and lose its checkpoint. So the directory is derived from
what the ranks of one run share: the SLURM job id, torchrun's run id (or the start
time of the torchrun agent all local workers descend from), or, for a plain run,
the time now, made unique by creating the directory atomically.

This module is also the one place that spells a run dir's layout, and owns the atomic write that
every file in it goes through (write, fsync, rename: a kill leaves the old file or the new one):

    RUN_DIR/result.json                     rank 0, at the end (the function's metrics, timings)
    RUN_DIR/metrics.jsonl                   rank 0, what run.log wrote
    RUN_DIR/checkpoint.pt                   rank 0, every checkpoint.every_steps and at a stop
    RUN_DIR/checkpoint/                     instead, checkpoint.format=dcp (launch.wrap=fsdp): every rank's
        .metadata, __<rank>_0.distcp,       shards (torch.distributed.checkpoint) and rank 0's expgpu.pt,
        expgpu.pt                           renamed into place from .checkpoint.tmp-<step>/ (expgpu.checkpoint.sharded)
    RUN_DIR/plan.json                       the node plan (dry run and spawn)
    RUN_DIR/.hydra/config.yaml              the composed config, as Hydra saves it (a sbatch restart reads it)
    RUN_DIR/logs/rank<N>.log                each spawned rank's log
    RUN_DIR/logs/rank<N>.script.log         a script task's output on rank N (stdout and stderr, every attempt)
    RUN_DIR/logs/rank<N>.out                what rank N > 0 printed, under launch.stdout=rank0
    RUN_DIR/hang/rank<N>.txt, verdict.json  a hang's stacks, every thread of every rank, and what was said
                                            (expgpu.train.watchdog)
    RUN_DIR/hang-<N>/                       attempt N's hang/ (and its result.json), moved aside when the world
                                            started again (launch.on_hang=restart, expgpu.launch.restarts)
    RUN_DIR/metrics.csv, tensorboard/,      rank 0, the chosen loggers (expgpu.loggers)
        wandb/, mlflow.db (a single run)
    RUN_DIR/.expgpu/                        expgpu's hand-over files between its own processes:
        config.json, logging.json           the resolved config and hydra.job_logging, for spawned ranks
        process.json                        the process in charge of the run (rank 0's, or its supervisor's): pid,
                                            host, its start, the SLURM job; `expgpu status` tells a running run
                                            from a lost one by it (expgpu.results.write_process)
        rank<N>.failure.json                the one-line reason a rank failed (the report shows it)
        failure.json                        the one-line reason the job failed, whatever the launcher
        loggers.json                        the job's sweep and overrides, the loggers' run ids (resume)
        plan-<host>-<launch>.json           local rank 0's GPU plan, for the node's other ranks
        store-<launch>.port                 rank 0's TCPStore port, for spawned ranks
        script-rank<N>.json                 how rank N's script ended (exit code, stop), for rank 0's result
        script-log.json                     where this attempt's expgpu.log rows begin, for the loggers
        script-watch-rank<N>.json           where rank N's script is (its last row's step, when it moved, its
                                            output), for the ranks' hang verdict (expgpu.script.watch)
        script-frame-rank<N>.json           where a hung script was (its frame, by py-spy), for the verdict's line
        script-hang-<launch>.json           a launch's hang claimed by the first rank that saw it
        backstop-rank<N>.txt                faulthandler's dump of a rank whose watchdog could not run
        attempts.json                       this launch's failed attempts (a crash, a hang), one row each, for
                                            rank 0's result.json and the restart loop (expgpu.launch.restarts)
        rank<N>.node.json                   the SLURM node rank N runs on (this attempt's), for a failure that is
                                            one node's (expgpu.launch.bad_nodes)
        excluded-nodes.json                 the nodes a SLURM job left out after such a failure (launch.
                                            exclude_bad_nodes), one row each, for rank 0's result.json

and, for any sweep:

    SWEEP_DIR/.expgpu/process.json          the sweep's process, as a run's (expgpu.status.busy: one live sweep
                                            per sweep dir)

and, under hydra/sweeper=expgpu_optuna (expgpu.tune):

    SWEEP_DIR/optuna.journal                the study (unless hydra.sweeper.storage names another)
    SWEEP_DIR/study.json                    every trial: state, params, values, pruned step, job dir
    SWEEP_DIR/.expgpu/trial-<n>.json        what attaches trial n's job to it (storage, study, pruner)

and, under hydra/launcher=gpu_pool:

    SWEEP_DIR/pool.json                     every job of every launch() batch: GPUs, times, outcome
    SWEEP_DIR/.expgpu/pool-spares.log       output of job processes not yet given a job (kept if not empty)
    SWEEP_DIR/.expgpu/pool-context-<pid>.pkl  Hydra's context and the task function, for every job
    JOB_DIR/console.log                     the job's stdout and stderr
    JOB_DIR/.expgpu/pool-job.pkl, pool-return.pkl  the job handed to its process, its JobReturn (removed after)
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from pathlib import Path
from typing import Mapping

from expgpu import envvars

RESULT = "result.json"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.pt"
SHARDED_CHECKPOINT = "checkpoint"
PLAN = "plan.json"
STATE = ".expgpu"
POOL_RECORD = "pool.json"
CONSOLE = "console.log"
POOL_JOB, POOL_RETURN, SPARES_LOG = "pool-job.pkl", "pool-return.pkl", "pool-spares.log"
STUDY = "study.json"
HANG = "hang"
# A slurm_pool sweep's own files in its sweep dir: its allocation's script, record (job.json) and output
SLURM_POOL = ".slurm_pool"


def hydra_config(run_dir: Path) -> Path:
    return Path(run_dir) / ".hydra" / "config.yaml"


def state_dir(run_dir: Path) -> Path:
    return Path(run_dir) / STATE


def config_file(run_dir: Path) -> Path:
    return state_dir(run_dir) / "config.json"


def logging_file(run_dir: Path) -> Path:
    return state_dir(run_dir) / "logging.json"


def hang_dir(run_dir: Path) -> Path:
    return Path(run_dir) / HANG


def hang_stack(run_dir: Path, rank: int) -> Path:
    return hang_dir(run_dir) / f"rank{rank}.txt"


def hang_verdict(run_dir: Path) -> Path:
    return hang_dir(run_dir) / "verdict.json"


def hang_dir_of_attempt(run_dir: Path, attempt: int) -> Path:
    return Path(run_dir) / f"{HANG}-{attempt}"


def attempts_file(run_dir: Path) -> Path:
    return state_dir(run_dir) / "attempts.json"


def rank_node_file(run_dir: Path, rank: int) -> Path:
    return state_dir(run_dir) / f"rank{rank}.node.json"


def excluded_nodes_file(run_dir: Path) -> Path:
    return state_dir(run_dir) / "excluded-nodes.json"


def backstop_file(run_dir: Path, rank: int) -> Path:
    return state_dir(run_dir) / f"backstop-rank{rank}.txt"


def process_file(run_dir: Path) -> Path:
    return state_dir(run_dir) / "process.json"


def failure_file(run_dir: Path, rank: int) -> Path:
    return state_dir(run_dir) / f"rank{rank}.failure.json"


def failure_files(run_dir: Path) -> list[Path]:
    return sorted(state_dir(run_dir).glob("rank*.failure.json"))


def failure_ranks(run_dir: Path) -> list[int]:
    """The ranks that left a failure_file in `run_dir`."""
    return sorted(int(p.name.removeprefix("rank").split(".")[0]) for p in failure_files(run_dir))


def job_failure_file(run_dir: Path) -> Path:
    return state_dir(run_dir) / "failure.json"


def loggers_file(run_dir: Path) -> Path:
    return state_dir(run_dir) / "loggers.json"


def node_plan_file(run_dir: Path, host: str, launch: str) -> Path:
    return state_dir(run_dir) / f"plan-{host}-{launch}.json"


def store_port_file(run_dir: Path, launch: str) -> Path:
    return state_dir(run_dir) / f"store-{launch}.port"


def rank_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank{rank}.log"


def script_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank{rank}.script.log"


def script_record(run_dir: Path, rank: int) -> Path:
    return state_dir(run_dir) / f"script-rank{rank}.json"


def script_log_marker(run_dir: Path) -> Path:
    return state_dir(run_dir) / "script-log.json"


def script_held_rows(run_dir: Path) -> Path:
    """The rows a resumed script's attempt holds back until it has logged its first step again (expgpu.script.log)."""
    return state_dir(run_dir) / "script-held-rows.jsonl"


def script_watch(run_dir: Path, rank: int) -> Path:
    return state_dir(run_dir) / f"script-watch-rank{rank}.json"


def script_frame(run_dir: Path, rank: int) -> Path:
    return state_dir(run_dir) / f"script-frame-rank{rank}.json"


def script_hang_claim(run_dir: Path, launch: str) -> Path:
    return state_dir(run_dir) / f"script-hang-{launch}.json"


def script_pruned(run_dir: Path, launch: str) -> Path:
    """Made by rank 0 of a script task's trial before it stops its script: the other ranks stop theirs."""
    return state_dir(run_dir) / f"script-pruned-{launch}"


def rank_stdout(run_dir: Path, rank: int) -> Path:
    """What a rank other than 0 printed, under launch.stdout=rank0."""
    return Path(run_dir) / "logs" / f"rank{rank}.out"


def allocation_record(sweep_dir: Path) -> Path:
    """A slurm_pool sweep's record of the SLURM job it submitted (expgpu.slurm.sweep_job.submit_command)."""
    return Path(sweep_dir) / SLURM_POOL / "job.json"


def mtime(path: Path) -> float:
    """When `path` last changed; 0.0 where it does not exist (or cannot be read)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, a second Ctrl-C: the old file stays, the partial one goes
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(path)   # a write's own error names no file: the one that was not written
        raise
    fsync_dir(path.parent)


def wait_for_file(path: Path, timeout_s: float, what: str) -> str:
    """The text of a file another process publishes with atomic_write_bytes (never half-written).

    Raises RuntimeError naming `what` when it does not appear within timeout_s.
    """
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:.0f}s ({path})")
        time.sleep(0.01)
    return path.read_text()

_chosen: dict[str, str] = {}
# False when the command only prints (--cfg, --info, --help, shell completion): the name is still
# resolved, but no directory is claimed, so printing a config creates nothing.
claim = True


def _stamp(t: float) -> tuple[str, str]:
    d = _dt.datetime.fromtimestamp(t)
    return d.strftime("%Y-%m-%d"), d.strftime("%H-%M-%S")


def default_run_dir(root: str = "outputs", env: Mapping[str, str] | None = None, now: float | None = None) -> str:
    env = os.environ if env is None else env
    if env.get(envvars.RUN_DIR):
        return env[envvars.RUN_DIR]
    if env.get("SLURM_JOB_ID"):
        job = env["SLURM_JOB_ID"]
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        return f"{root}/slurm/{job}"  # the same after `scontrol requeue`
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"{root}/torchrun/{run_id}"
    if run_id == "none":
        # Standalone torchrun without --rdzv-id: all local workers share the agent,
        # whose start time is the same for each of them.
        import psutil

        day, hms = _stamp(psutil.Process(os.getppid()).create_time())
        return f"{root}/{day}/{hms}-torchrun{os.getppid()}"
    day, hms = _stamp(now if now is not None else _dt.datetime.now().timestamp())
    base = Path(root) / day / hms
    if not claim:
        return str(base)
    # Two runs started within the same second must not share a directory (and
    # resume each other's checkpoints): claim one with an atomic mkdir.
    for n in range(1000):
        candidate = base if n == 0 else base.with_name(f"{hms}_{n}")
        try:
            candidate.mkdir(parents=True)
            return str(candidate)
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory under {base.parent}")


def resolver(root: str = "outputs") -> str:
    # Hydra may resolve hydra.run.dir more than once; the answer must not change.
    if root not in _chosen:
        _chosen[root] = default_run_dir(root)
    return _chosen[root]


def register() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("expgpu_run_dir"):
        OmegaConf.register_new_resolver("expgpu_run_dir", resolver)
