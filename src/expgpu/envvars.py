"""The EXPGPU_* environment variables: how expgpu's processes tell each other what they need, and the
few a user sets. One name each, spelled here only (grep for the constant, not the string).

A user may set: WARM_SERVER, WARM_RANKS, CACHE_DIR, LEASE_DIR, ATEXIT_GRACE_S, TORCH (scripts/setup-env.sh),
SPARE_NODES and PYTHON (scripts/expgpu.sbatch); one of those misspelt is an error (`misspelt`).
Everything else is set by one expgpu process for another and is kept out of what a script task's own
process inherits where it would mislead it (expgpu.script.environ).
"""

# A rank of expgpu's own spawn (expgpu.launch.spawn -> expgpu.ranks.local): who it is and its peers.
RANK = "EXPGPU_RANK"
LOCAL_RANK = "EXPGPU_LOCAL_RANK"
WORLD_SIZE = "EXPGPU_WORLD_SIZE"
LOCAL_WORLD_SIZE = "EXPGPU_LOCAL_WORLD_SIZE"
NODE_RANK = "EXPGPU_NODE_RANK"
MASTER_ADDR = "EXPGPU_MASTER_ADDR"
MASTER_PORT = "EXPGPU_MASTER_PORT"   # 0: rank 0 binds a free port and publishes it in the run dir
LAUNCH_ID = "EXPGPU_LAUNCH_ID"       # one launch's ranks (their shared node plan and store port files)
RUN_DIR = "EXPGPU_RUN_DIR"           # the run dir a launcher chose for its job (expgpu.rundir)
START_TIME = "EXPGPU_START_TIME"     # when the launch (or a pool job's hand-over) began: startup_s counts from it
STOP_SIGNALS = "EXPGPU_STOP_SIGNALS"   # the signals a worker stops on: its supervisor's (expgpu.procs.signals)
STOP_AT = "EXPGPU_STOP_AT"           # checkpoint.verify: every rank stops at this step, as on SIGTERM
# Which attempt of the run this process belongs to (1: the first), set by the loop that restarts it (expgpu.launch.
# restarts: expgpu's spawn for its ranks, scripts/expgpu.sbatch for its srun steps); a supervisor that finds it set
# leaves restarts to that outer loop
ATTEMPT = "EXPGPU_ATTEMPT"
# user, read by scripts/expgpu.sbatch only: its srun step runs on this many nodes fewer than the job got, spares
# that replace a node a crash or a hang was on (launch.exclude_bad_nodes, expgpu.launch.bad_nodes)
SPARE_NODES = "EXPGPU_SPARE_NODES"

# Warm processes (expgpu.launch.warm, expgpu.launch.warm_server)
WARM_SERVER = "EXPGPU_WARM_SERVER"   # user: the socket of a warm server that launches fork their ranks from
WARM_RANKS = "EXPGPU_WARM_RANKS"     # user: 0 starts every rank fresh
WARM_PARENT = "EXPGPU_WARM_PARENT"   # the pid a warm process dies with

# The gpu_pool launcher (expgpu.pool) and its job processes
POOL_PREFIX = "EXPGPU_POOL_"
POOL_PARENT = "EXPGPU_POOL_PARENT"   # the launcher a spare dies with
POOL_JOB = "EXPGPU_POOL_JOB"         # the job number a process runs
POOL_GPUS = "EXPGPU_POOL_GPUS"       # its leased GPUs (NVML indices)
POOL_SLOT = "EXPGPU_POOL_SLOT"       # its CPU slot, when it leased no GPU
LEASE_DIR = "EXPGPU_LEASE_DIR"       # user: where the per-GPU lock files live

# Script tasks (expgpu.script): what `expgpu.log` in the script's own process reads
SCRIPT_RUN_DIR = "EXPGPU_SCRIPT_RUN_DIR"
SCRIPT_RESUMED = "EXPGPU_SCRIPT_RESUMED"
SCRIPT_HEARTBEAT = "EXPGPU_SCRIPT_HEARTBEAT"   # the file expgpu.log beats in, each rank's (expgpu.script.heartbeat)
SCRIPT_PROMPT = "EXPGPU_SCRIPT_PROMPT"   # a trial's objective, whose rows expgpu.log writes at once (script.prune)

TRIAL = "EXPGPU_TRIAL"               # an optimizing sweeper's trial file (expgpu.tune)
CACHE_DIR = "EXPGPU_CACHE_DIR"       # user: measured GPU scores (default ~/.cache/expgpu)
ATEXIT_GRACE_S = "EXPGPU_ATEXIT_GRACE_S"   # user: how long atexit handlers may run in a fast exit

# user, read by scripts only: the torch build the set-up installs (scripts/setup-env.sh), the Python that
# scripts/expgpu.sbatch runs
TORCH = "EXPGPU_TORCH"
PYTHON = "EXPGPU_PYTHON"
USER_SET = (WARM_SERVER, WARM_RANKS, CACHE_DIR, LEASE_DIR, ATEXIT_GRACE_S, SPARE_NODES, TORCH, PYTHON)


def misspelt(environ) -> str | None:
    """The line for an EXPGPU_* variable in `environ` that expgpu reads nowhere but that is one slip from one a user
    sets (EXPGPU_LEASEDIR): it would be ignored, and two sweeps would lease GPUs in different places. None when
    there is none; names far from every user-set one are left alone (other tools' variables)."""
    known = {v for k, v in globals().items() if k.isupper() and isinstance(v, str) and v.startswith("EXPGPU_")}
    for name in sorted(environ):
        if not name.startswith("EXPGPU_") or name in known or name.startswith(POOL_PREFIX):
            continue
        import difflib

        close = difflib.get_close_matches(name, USER_SET, n=1, cutoff=0.85)
        if close:
            return (f"{name}: expgpu reads no such environment variable (did you mean {close[0]}?); those a user "
                    f"sets: {', '.join(USER_SET)}")
    return None
