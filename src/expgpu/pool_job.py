"""One gpu_pool job in a process of its own: `python -m expgpu.pool_job FD`, and the launcher's
handle on it (Spare).

The launcher starts this process ahead of its job (a warm spare, as Ray prestarts its workers):
it imports Hydra, says "ready" on its socket (FD) and waits. A sweep of short jobs would
otherwise spend much of each slot on Python and Hydra starting up. Until it is given a job it
runs no code of the user's and sees no GPU: it starts with CUDA_VISIBLE_DEVICES="" (on a machine
with GPUs), so even a stray CUDA call could not land on another job's card.

Its job arrives as one message: the job's environment (CUDA_VISIBLE_DEVICES with its leased
GPUs, EXPGPU_POOL_*), where its output goes, its job file, and, as SCM_RIGHTS, the lease
descriptors, which this process then holds until it exits (expgpu.leases). The environment is set
before anything of the job's is unpickled or imported (CUDA reads CUDA_VISIBLE_DEVICES once, when
it initializes, and nothing before this point can have initialized it), then the job runs as in
Hydra's own launchers: restore Hydra's singletons, run_job(), send back the JobReturn
(cloudpickle, in the job dir), exit 0 when the job completed, 1 when it failed.

Waiting for a job has no time limit of its own: the process dies with the launcher
(PR_SET_PDEATHSIG) and leaves when the launcher closes the socket.

The launcher's import path comes first on sys.path (its script's directory, --config-dir task
modules), so the task function and the configs' _target_s import here as they did there.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

SPARES_LOG = "pool-spares.log"   # in the sweep's .expgpu/: output of processes not yet given a job

_held: list[int] = []   # the job's lease descriptors: open for as long as this process lives


# ---------------------------------------------------------------------------------------------
# The launcher's side

class Spare:
    """A job's process, started before its job (expgpu.pool_job) and warming up until it gets one."""

    def __init__(self, state: Path, hide_gpus: bool):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXPGPU_POOL_")}
        env["EXPGPU_POOL_PARENT"] = str(os.getpid())
        if hide_gpus:  # no GPU at all until it is told its own
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.log = state / SPARES_LOG
        try:
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "expgpu.pool_job", str(theirs.fileno())], env=env,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    pass_fds=[theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock: socket.socket | None = ours
        self.ready = False

    def is_ready(self) -> bool:
        if not self.ready and self.sock is not None:
            try:
                self.ready = self.sock.recv(16) == b"ready"
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                pass
        return self.ready

    def alive(self) -> bool:
        return self.proc.poll() is None

    def give(self, spec: dict, fds: list[int]) -> None:
        """Hand over a job: its environment and output file, and its lease descriptors."""
        msg = json.dumps(spec).encode()
        if fds:
            socket.send_fds(self.sock, [msg], fds)
        else:
            self.sock.sendmsg([msg])
        self.sock.close()
        self.sock = None

    def dismiss(self) -> None:
        """No job for it after all: it holds nothing and ran nothing of anyone's, so it just goes."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        _kill_group(self.proc.pid)
        self.proc.wait()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)   # it leads its own session: its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------
# The job's side



def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the launcher's process-group kill is all there is
        return
    parent = os.environ.get("EXPGPU_POOL_PARENT")
    if parent and os.getppid() != int(parent):  # the launcher died before we could ask
        os._exit(137)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _outcome(ret) -> dict:
    from hydra.core.utils import JobStatus

    if ret.status is JobStatus.COMPLETED:
        return {"state": "finished"}
    err = ret._return_value
    stopped = type(err).__name__ == "Stopped" and type(err).__module__ == "expgpu.app"
    return {"state": "stopped" if stopped else "failed", "error": _one_line(err)}


def wait_for_job(sock: socket.socket) -> dict | None:
    """The job the launcher hands over, or None when it has none left for this process."""
    try:
        sock.sendall(b"ready")
    except OSError:   # the launcher may have handed over a job and hung up before we were ready
        pass
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 256)
    except OSError:
        return None
    if not msg:
        return None
    _held.extend(fds)
    spec = json.loads(msg)
    out = os.open(spec["console"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.update(spec["env"])   # before anything of the job's runs
    sock.close()
    return spec


def run(job_file: Path) -> int:
    """Run the job in `job_file` as Hydra's launchers do; the exit code says how it went."""
    import cloudpickle
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals

    from expgpu import rundir
    from expgpu.errors import UserError

    with open(job_file, "rb") as f:
        sys.path[:0] = [p for p in pickle.load(f) if p not in sys.path]
        spec = pickle.load(f)
    with open(spec["context"], "rb") as f:
        hydra_context, task_function, singletons = pickle.load(f)
    Singleton.set_state(singletons)
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
    path = Path(spec["return"])
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return 0 if ret.status is JobStatus.COMPLETED else 1


def main(argv: list[str] | None = None) -> None:
    _die_with_parent()
    sock = socket.socket(fileno=int((sys.argv[1:] if argv is None else argv)[0]))
    # Warm up: what every job needs (and expgpu's own entry, which imports neither torch nor
    # CUDA), none of it the job's own code.
    import cloudpickle  # noqa: F401
    import hydra.core.utils  # noqa: F401

    import expgpu.app  # noqa: F401
    import expgpu.checkpoint  # noqa: F401
    import expgpu.rundir  # noqa: F401

    spec = wait_for_job(sock)
    if spec is None:
        sys.exit(0)
    os.environ["EXPGPU_START_TIME"] = str(time.time())   # a job's start-up counts from its hand-over
    code = run(Path(spec["job_file"]))
    # The job is over and all it sends back is on disk: skip interpreter shutdown, which for a
    # process that loaded Hydra and torch takes tens of milliseconds of every job's slot (and
    # where a gloo thread left by the job could abort it: expgpu.dist._let_gloo_threads_finish).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
