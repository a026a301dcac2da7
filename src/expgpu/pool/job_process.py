"""One gpu_pool job in a process of its own: `python -m expgpu.pool.job_process FD` (expgpu.pool.spares
starts it ahead of its job), or a fork of `python -m expgpu.pool.job_process --forkserver FD`
(expgpu.procs.forkserver), which warms up once for all the sweep's jobs.

Warming up: it imports Hydra and expgpu's entry, says "ready" on its socket (FD), and while it
waits imports what the launcher names (torch, expgpu's line and the task's modules, for an expgpu
app). Importing torch does not start CUDA (nothing here calls into torch.cuda; warm_up checks), so
CUDA_VISIBLE_DEVICES can still be set per job afterwards: CUDA reads it once, when it initializes.

Its job arrives as one message: the job's environment (CUDA_VISIBLE_DEVICES with its leased GPUs,
its thread budget, EXPGPU_POOL_*), where its output goes, its job file, and, as SCM_RIGHTS, the
lease descriptors, which this process then holds until it exits (expgpu.pool.leases). The environment
is set before anything of the job's is unpickled, then the job runs as in Hydra's own launchers:
restore Hydra's singletons, run_job(), send back the JobReturn (cloudpickle, in the job dir), run
the job's atexit handlers, exit 0 when the job completed, 1 when it failed.

Primed (Spare.prime): the job arrives in two messages. The first, while the job's GPUs or slot are
still busy with an earlier job, names its job file and output: Hydra's run_job does its set-up
(config copies, the job dir's .hydra/, logging) and stops where the task function starts, waiting
for the second, the hand-over above (environment, leases). The job's start-up is then only its own.

Waiting for a job has no time limit of its own: the process dies with the launcher
(PR_SET_PDEATHSIG) and leaves when the launcher closes the socket.

The launcher's import path comes first on sys.path (its script's directory, --config-dir task
modules), so the task function and the configs' _target_s import here as they did there.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import pickle
import socket
import sys
import time
import traceback
from pathlib import Path

from expgpu import envvars, procs
from expgpu.errors import Stopped, UserError, one_line
from expgpu.procs.forkserver import warm_imports

_held: list[int] = []   # the job's lease descriptors: open for as long as this process lives
# What warm_up prepared besides imports: "plugins", Hydra's plugin scan (as every job's
# Singleton.set_state would redo it); "context", (path, the launcher's context file, unpickled).
_ahead: dict = {}


def warm_up(modules: list[str], path: list[str] = (), context: str | None = None) -> None:
    """Import what jobs need before there is a job (forkserver.warm_imports), and do Hydra's part of
    every job's set-up that is no job's own: the plugin scan, the launcher's context unpickled."""
    warm_imports(modules, path)
    if path:   # on the launcher's import path, the scan finds the plugins the job's would
        from hydra.core.plugins import Plugins

        _ahead["plugins"] = Plugins.instance()
    if context and _ahead.get("context", (None,))[0] != context:   # a later launch() has its own
        try:
            with open(context, "rb") as f:
                _ahead["context"] = (context, pickle.load(f))
        except Exception:   # the job reads it again and says what is wrong
            pass
    gc.freeze()   # what was unpickled too


def _restore(context: str) -> tuple:
    """(Hydra's context, the task function) with Hydra's singletons restored, as Hydra's
    Singleton.set_state does, but with what warm_up prepared ahead."""
    from hydra.core.plugins import Plugins
    from hydra.core.singleton import Singleton
    from omegaconf.basecontainer import BaseContainer

    path, loaded = _ahead.get("context", (None, None))
    if path != context:
        with open(context, "rb") as f:
            loaded = pickle.load(f)
    hydra_context, task_function, state = loaded
    plugins = _ahead.get("plugins")
    if plugins is None:
        Singleton.set_state(state)
    else:
        Singleton._instances = {**state["instances"], Plugins: plugins}
        BaseContainer._resolvers = copy.deepcopy(state["omegaconf_resolvers"])
    return hydra_context, task_function


def _receive(sock: socket.socket, block: bool):
    """The launcher's next message that is not a "warm" one (those are acted on here): (spec, fds);
    None when the launcher hung up, or, not blocking, when nothing more is there yet."""
    sock.setblocking(block)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 256)
        except BlockingIOError:
            return None
        except ConnectionResetError:   # the launcher hung up; what it sent before is still there
            if not block:
                return None
            return _receive(sock, block=False)
        except OSError:
            return None
        if not msg:
            return None
        spec = json.loads(msg)
        if "warm" not in spec:
            return spec, fds
        warm_up(spec["warm"], spec["path"], spec.get("context"))   # the task's modules, from the launcher


def console(path: str) -> None:
    """From now on this process writes where the job's output goes."""
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)


def take_job(spec: dict, fds: list[int]) -> None:
    """Become the job's process: hold its leases, take its environment and thread budget."""
    _held.extend(fds)
    os.environ.update(spec["env"])   # before anything of the job's runs
    os.environ[envvars.START_TIME] = str(time.time())   # a job's start-up counts from its hand-over
    if spec.get("threads") and "torch" in sys.modules:
        # torch read OMP_NUM_THREADS when the spare imported it, before the budget was known
        sys.modules["torch"].set_num_threads(int(spec["threads"]))


def _go(sock: socket.socket) -> None:
    """A primed job's hand-over, where its task function starts: wait for its environment (its
    GPUs) and leases; leave, having run nothing of the job's, if the launcher has no use for it."""
    from hydra.core.hydra_config import HydraConfig

    got = _receive(sock, block=True)
    if got is None:
        os._exit(0)
    spec, fds = got
    sock.close()
    # run_job has set the job's hydra.job.env_set: it wins over the pool's variables, as it does
    # when run_job starts after the hand-over.
    mine = set(HydraConfig.get().job.env_set or {})
    take_job({**spec, "env": {k: v for k, v in spec["env"].items() if k not in mine}}, fds)


def _outcome(ret) -> dict:
    from hydra.core.utils import JobStatus

    if ret.status is JobStatus.COMPLETED:
        return {"state": "finished"}
    err = ret._return_value
    return {"state": "stopped" if isinstance(err, Stopped) else "failed", "error": one_line(err)}


def run_job(job_file: Path, go=None, send_back: bool = True) -> int:
    """Run the job in `job_file` as Hydra's launchers do; the exit code says how it went.

    go: for a primed job, called where its task function starts (run_job's set-up is done by
    then: the job's config saved, its logging set, its hydra.job.env_set applied). send_back: False
    in the ranks of an srun step but the first (expgpu.pool.step_process): one JobReturn per job."""
    from hydra.core.utils import JobStatus, run_job, setup_globals

    from expgpu import rundir

    with open(job_file, "rb") as f:
        sys.path[:0] = [p for p in pickle.load(f) if p not in sys.path]
        spec = pickle.load(f)
    hydra_context, task_function = _restore(spec["context"])
    if go is not None:
        task_function = _after(go, task_function)
    setup_globals()
    rundir.register()  # resolvers live in a process: hydra.run.dir names expgpu_run_dir
    try:
        ret = run_job(hydra_context=hydra_context, task_function=task_function, config=spec["config"],
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    except KeyboardInterrupt:
        print("expgpu: job interrupted", file=sys.stderr)
        return 130
    outcome = _outcome(ret)
    if ret.status is JobStatus.FAILED:  # run_job keeps the exception; show it where users look
        err = ret._return_value
        if isinstance(err, UserError):
            print(f"expgpu: error: {err}", file=sys.stderr)
        elif outcome["state"] == "stopped":
            print(f"expgpu: {err}", file=sys.stderr)
        else:
            traceback.print_exception(type(err), err, err.__traceback__)
    if send_back:
        _send_back(ret, outcome, Path(spec["return"]))
    return 0 if ret.status is JobStatus.COMPLETED else 1


def _after(go, task_function):
    @functools.wraps(task_function)
    def gated(cfg):
        go()
        return task_function(cfg)

    return gated


def _send_back(ret, outcome: dict, path: Path) -> None:
    import cloudpickle
    from hydra.core.utils import JobStatus

    from expgpu.pool.jobs import replace

    # cloudpickle, as submitit does: Hydra's config nodes are typed by plugin dataclasses that
    # Hydra's plugin scan loaded outside sys.modules, which plain pickle refuses.
    try:
        data = cloudpickle.dumps((ret, outcome))
        if ret.status is JobStatus.FAILED:
            pickle.loads(data)   # an exception whose __init__ pickle cannot call again
    except Exception:  # an exception or return value that does not survive pickling
        if ret.status is JobStatus.COMPLETED:
            print("expgpu: warning: the job's return value cannot be pickled; the sweep gets None",
                  file=sys.stderr)
            ret.return_value = None
        else:
            ret.return_value = RuntimeError(outcome.get("error") or "the job failed")
        data = cloudpickle.dumps((ret, outcome))
    # Read by the launcher the moment this process exits, then deleted: whole (write, rename) is
    # enough; an fsync would only slow every job's exit.
    replace(path, data)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    parent = os.environ.get(envvars.POOL_PARENT)
    procs.die_with_parent(int(parent) if parent else None)
    sock = socket.socket(fileno=int(args[-1]))
    # What every job needs, none of it the job's own code; torch and the task's modules come with
    # the launcher's "warm" message once it knows the app is expgpu's (spares.task_modules).
    warm_up(["cloudpickle", "hydra.core.utils", "hydra._internal.logging_config", "omegaconf._impl", "expgpu.app",
             "expgpu.checkpoint.file", "expgpu.rundir"])
    # OmegaConf's interpolation grammar (antlr) builds its parser tables at the first ${...} a process
    # resolves: ~40 ms of every job's set-up in Hydra's run_job, paid here once.
    from omegaconf import OmegaConf

    OmegaConf.create({"a": 1, "b": "${a}"}).b
    if args[0] == "--forkserver":
        from expgpu.procs import forkserver

        forkserver.serve(sock, warm_up, spare)
    spare(sock)


def spare(sock: socket.socket) -> None:
    """Wait for a job on `sock`, run it, exit."""
    # "ready" only once the modules the launcher named at start are in too (torch: seconds): the
    # launcher warms one spare at a time, and gives a job to a ready spare first.
    got = _receive(sock, block=False)
    try:
        sock.sendall(b"ready")
    except OSError:   # the launcher may have hung up (no job for us after all)
        pass
    got = got or _receive(sock, block=True)
    if got is None:
        os._exit(0)   # ran nothing of anyone's: nothing to flush
    spec, fds = got
    console(spec["console"])
    if spec.get("prime"):   # its job, ahead of its GPUs: Hydra's set-up now, the rest at the hand-over
        code = run_job(Path(spec["job_file"]), go=lambda: _go(sock))
    else:
        sock.close()
        take_job(spec, fds)
        code = run_job(Path(spec["job_file"]))
    # The job is over and all it sends back is on disk: its atexit handlers run, interpreter
    # shutdown does not (procs.fast_exit says why).
    procs.fast_exit(code)


if __name__ == "__main__":
    main()
