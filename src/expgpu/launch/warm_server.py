"""A warm process that outlives launches: `python -m expgpu.warm_server PATH`, then
EXPGPU_WARM_SERVER=PATH, and the ranks of every launch are forks of it, torch already imported.

expgpu.launch.warm starts a warm process per launch: torch's import (2-3 CPU-seconds) is paid once
per launch, and a one-rank launch gains nothing (its one rank pays as much). This server pays it
once for every launch that names it: each rank, a one-rank launch's too, starts about 2 s sooner.
For iterating on one machine (run, edit the task, run again), and for this project's test suite.

A fork gets what expgpu.launch.warm sets for a fresh rank (environment, argv, seeds, threads), and
what differs between launches: the launch's working directory, its standard input, output and
error (passed as descriptors), and sys.path (the launch's directory and PYTHONPATH in front of
the server's site). The server refuses a launch it cannot stand in for, and the launch starts its
ranks as it would without it, after one warning that says why:
- another interpreter, or expgpu's or torch's files changed since the server imported them;
- a variable read when an interpreter or torch starts (PYTHON*, TORCH*, LD_*, OMP_*...), other
  than the thread counts a rank sets itself, with another value than the server's;
- a module the server imported that the launch's directory or PYTHONPATH would shadow.
A launch's own modules (its task, its configs' targets) are imported in the fork, fresh each time.

Lifetimes: a rank dies with the server (PR_SET_PDEATHSIG) and with its launcher. A rank's
connection stays open until it exits; when it closes first (the launcher died), the server kills
the rank's process group. The server ends on SIGTERM or SIGINT, and so do the ranks it runs then;
with EXPGPU_WARM_PARENT=PID, also when that process (a program that owns it: the tests) dies.
Only processes of the server's own user may connect (SO_PEERCRED; the socket is 0600).

One SOCK_SEQPACKET connection per request:
    launcher -> server  {"check": launch}                  -> {"ok": true} | {"refused": why}
                        {"job": launch} + stdin, stdout, stderr (SCM_RIGHTS)
                                                           -> {"pid": pid} | {"refused": why},
                                                              then {"code": exit code as Popen's}
    launch: {"python": sys.executable, "cwd": ..., "env": {...}, "argv": [...]}
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path

from expgpu import envvars, procs
from expgpu.errors import UserError
from expgpu.launch.warm_client import ENV
from expgpu.procs import forkserver, stop_signals

# Read when an interpreter, torch or its libraries start: a fork keeps the server's values.
START_VARS = ("PYTHON", "TORCH", "PYTORCH", "LD_", "MKL_", "KMP_", "OMP_", "GOMP_", "OPENBLAS_", "MALLOC_")
# ...but these a rank sets for itself (sys.path; torch's threads), as a fork of expgpu.launch.warm does.
PER_LAUNCH = {"PYTHONPATH", *procs.THREAD_VARS, procs.BLAS_VAR}

_BASE_PATH: list[str] = []   # sys.path at start, and its PYTHONPATH part
_OWN_PYTHONPATH: list[str] = []
_STAMP: dict[str, int] = {}
_START_ENV: dict[str, str] = {}   # os.environ before the imports (torch sets some of its own)


def _code_stamp() -> dict[str, int]:
    """The newest modification time of expgpu's and torch's files: their code in the server's
    memory is what was on disk then."""
    stamp = {"expgpu": max(p.stat().st_mtime_ns for p in Path(__file__).parent.rglob("*.py"))}
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        stamp["torch"] = (Path(spec.origin).parent / "version.py").stat().st_mtime_ns
    return stamp


def _pythonpath(env: dict[str, str], cwd: str) -> list[str]:
    return [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def refusal(launch: dict) -> str | None:
    """Why the server cannot stand in for a fresh process of this launch, or None."""
    if launch["python"] != sys.executable:
        return f"it runs {sys.executable}, this launch {launch['python']}"
    if _code_stamp() != _STAMP:
        return "expgpu's or torch's files changed since it started: restart it"
    env = launch["env"]
    for name in sorted(set(env) | set(_START_ENV)):
        if name.startswith(START_VARS) and name not in PER_LAUNCH and env.get(name) != _START_ENV.get(name):
            return f"{name}={env.get(name)!r} here, {_START_ENV.get(name)!r} in the server (read at start-up)"
    # Modules from files (a built-in or frozen one comes first in any process): a fresh process
    # would import one from the launch's directory or PYTHONPATH if it holds it.
    imported = {name: mod.__file__ for name, mod in list(sys.modules.items())
                if "." not in name and getattr(mod, "__file__", None)}
    for entry in [launch["cwd"], *_pythonpath(env, launch["cwd"])]:
        if entry in _BASE_PATH:
            continue
        for name, where in imported.items():
            if not where.startswith(entry + os.sep) and (
                    os.path.exists(os.path.join(entry, name, "__init__.py"))
                    or os.path.exists(os.path.join(entry, name + ".py"))):
                return f"{os.path.join(entry, name)} would shadow {name}, which it imported from {where}"
    return None


def _job_path(launch: dict) -> list[str]:
    """sys.path as `python -m` in the launch's directory with its PYTHONPATH would start with."""
    site = _BASE_PATH[1 + len(_OWN_PYTHONPATH):]
    added = [p for p in sys.path if p not in _BASE_PATH]   # by the warm-up's imports
    return [launch["cwd"], *_pythonpath(launch["env"], launch["cwd"]), *site, *added]


def _listen(path: str) -> socket.socket:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
        raise UserError(f"a warm server already listens on {path}: use it ({ENV}={path}) or stop it first")
    except OSError:
        pass
    finally:
        probe.close()
    _remove_socket(path)   # a server's that died without cleaning up
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o077)   # 0600: a connection can run code as this user
    try:
        sock.bind(path)
    except OSError as e:
        raise UserError(f"the warm server cannot listen on {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


class _Quit(Exception):
    pass


def serve(path: str) -> None:
    _START_ENV.update(os.environ)
    _BASE_PATH[:] = sys.path
    _OWN_PYTHONPATH[:] = _pythonpath(dict(os.environ), os.getcwd())
    listener = _listen(path)   # before the imports: a launch may connect and wait for them
    from expgpu.task import RANK_IMPORTS

    try:
        forkserver.warm_imports(RANK_IMPORTS)
        _STAMP.update(_code_stamp())
        print(f"expgpu: warm server {os.getpid()} ready: export {ENV}={path}", file=sys.stderr, flush=True)
        _loop(listener)
    except (_Quit, KeyboardInterrupt):
        pass
    finally:
        listener.close()
        _remove_socket(path)


def _remove_socket(path: str) -> None:
    if Path(path).is_socket():
        Path(path).unlink()


def _loop(listener: socket.socket) -> None:
    wakeups = forkserver.ChildWakeups()   # a child's exit, or a stop, wakes the select
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _quit)
    ranks: dict[socket.socket, int] = {}   # a rank's connection -> its pid
    while True:
        for ready in select.select([listener, wakeups.r, *ranks], [], [])[0]:
            if ready is listener:
                _answer(listener, ranks, wakeups)
            elif ready == wakeups.r:
                wakeups.drain()
                _reap(ranks)
            elif ready in ranks and not _said(ready):   # the launcher hung up first: it died
                procs.kill_group(ranks.pop(ready))
                ready.close()


def _said(conn: socket.socket) -> bytes:
    try:
        return conn.recv(16)
    except OSError:
        return b""


def _quit(signum, frame):
    raise _Quit()


def _answer(listener: socket.socket, ranks: dict, wakeups: forkserver.ChildWakeups) -> None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():
            return
        conn.settimeout(10)   # a launcher sends its request as soon as it connects
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        request = json.loads(msg)
        launch = request.get("check") or request["job"]
        why = refusal(launch)
        if why or "check" in request:
            conn.send(json.dumps({"refused": why} if why else {"ok": True}).encode())
            return
        pid = _fork(launch, fds, [listener, conn, *ranks], wakeups)
        conn.send(json.dumps({"pid": pid}).encode())
        ranks[conn] = pid
        conn = None
    except (OSError, ValueError, KeyError) as e:
        print(f"expgpu: warm server: a bad request ({e})", file=sys.stderr, flush=True)
    finally:
        for fd in fds:
            os.close(fd)
        if conn is not None:
            conn.close()


def _reap(ranks: dict) -> None:
    """Tell each exited rank's launcher its exit code, and hang up."""
    for pid, code in procs.reaped():
        for conn in [conn for conn, rank in ranks.items() if rank == pid]:
            del ranks[conn]
            try:
                conn.send(json.dumps({"code": code}).encode())
            except OSError:
                pass
            conn.close()


def _fork(launch: dict, fds: list[int], socks: list, wakeups: forkserver.ChildWakeups) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    # Stop signals stay held in the rank until its handler is in (as spawn's block_in_child).
    held = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals.STOP_SIGNALS)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return pid
    try:
        forkserver.after_fork(server, wakeups, socks)   # as spawn's ranks: a session of its own
        for sig, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            signal.signal(sig, default)   # the server's own quit handlers
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(launch["cwd"])
        sys.path[:] = _job_path(launch)
        from expgpu.launch.warm import run_rank

        run_rank(launch["env"], launch["argv"])   # ends in procs.fast_exit
    except BaseException:   # before the rank's own handling (its directory is gone): on the launch's stderr
        traceback.print_exc()
    finally:
        os._exit(1)


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print("usage: python -m expgpu.warm_server PATH   (a socket path; then export "
              f"{ENV}=PATH for the launches that should use it)", file=sys.stderr)
        sys.exit(2)
    parent = os.environ.pop(envvars.WARM_PARENT, None)   # a program that owns it (the tests): die with it
    if parent:
        procs.die_with_parent(int(parent))
    try:
        serve(os.path.abspath(sys.argv[1]))
    except UserError as e:
        print(f"expgpu: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
