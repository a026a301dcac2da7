"""A warm process that outlives launches: `python -m expgpu.warm_server PATH`, then
EXPGPU_WARM_SERVER=PATH, and the ranks of every launch are forks of it, torch already imported.

expgpu.warm_ranks starts a warm process per launch: torch's import (2-3 CPU-seconds) is paid once
per launch, and a one-rank launch gains nothing (its one rank pays as much). This server pays it
once for every launch that names it: each rank, a one-rank launch's too, starts about 2 s sooner.
For iterating on one machine (run, edit the task, run again), and for this project's test suite.

A fork gets what expgpu.warm_ranks sets for a fresh rank (environment, argv, seeds, threads), and
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
the rank's process group. The server ends on SIGTERM or SIGINT, and so do the ranks it runs then.
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
import time
from pathlib import Path

from expgpu import procs, stopping
from expgpu.errors import UserError

ENV = "EXPGPU_WARM_SERVER"
REPLY_TIMEOUT_S = 120.0   # the server may still be importing torch when the first launch asks
# Read when an interpreter, torch or its libraries start: a fork keeps the server's values.
START_VARS = ("PYTHON", "TORCH", "PYTORCH", "LD_", "MKL_", "KMP_", "OMP_", "GOMP_", "OPENBLAS_", "MALLOC_")
# ...but these a rank sets for itself (sys.path; torch's threads), as a fork of expgpu.warm_ranks does.
PER_LAUNCH = {"PYTHONPATH", *procs.THREAD_VARS, procs.BLAS_VAR}


# ---------------------------------------------------------------------------------------------
# The launcher's side

class WarmServer:
    """The server at `path`, checked for this launch's environment (raises Refused, or UserError
    when nothing listens there)."""

    def __init__(self, path: str, env: dict[str, str]):
        self.path = path
        self.ranks: list[RemoteRank] = []
        sock = self._connect()
        try:
            sock.send(json.dumps({"check": _launch(env, [])}).encode())
            answer = _reply(sock)
        finally:
            sock.close()
        if "refused" in answer:
            raise Refused(answer["refused"])

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise UserError(f"{ENV}={self.path!r}: no warm server listens there ({e.strerror}); start one with "
                            f"`python -m expgpu.warm_server {self.path}`, or unset {ENV}") from None
        return sock

    def start(self, env: dict[str, str], argv: list[str]) -> "RemoteRank":
        """A rank forked by the server, on this process's stdin, stdout and stderr."""
        sock = self._connect()
        try:
            socket.send_fds(sock, [json.dumps({"job": _launch(env, argv)}).encode()], [0, 1, 2])
            answer = _reply(sock)
        except BaseException:
            sock.close()
            raise
        if "pid" not in answer:
            sock.close()
            raise OSError(answer.get("refused", "no answer"))
        rank = RemoteRank(sock, answer["pid"])
        self.ranks.append(rank)
        return rank

    def close(self) -> None:
        """Hang up: a rank still running is then killed by the server."""
        for rank in self.ranks:
            rank.sock.close()


class Refused(Exception):
    """The server cannot stand in for this launch (the message says why)."""


class RemoteRank:
    """A forked rank, as much of subprocess.Popen as expgpu.spawn uses (pid, poll, wait, signals)."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid, self.code = sock, pid, None

    def poll(self) -> int | None:
        while self.code is None and select.select([self.sock], [], [], 0)[0]:
            try:
                msg = self.sock.recv(4096)
            except OSError:
                msg = b""
            self.code = json.loads(msg)["code"] if msg else -signal.SIGKILL   # no word: died with the server
        return self.code

    def wait(self, timeout: float = 30.0) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            select.select([self.sock], [], [], max(0.0, min(0.5, deadline - time.monotonic())))
        return self.code

    def send_signal(self, sig: int) -> None:
        """Not to one known to have exited; reads nothing (it may run in a signal handler)."""
        if self.code is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _launch(env: dict[str, str], argv: list[str]) -> dict:
    return {"python": sys.executable, "cwd": os.getcwd(), "env": env, "argv": argv}


def _reply(sock: socket.socket) -> dict:
    if not select.select([sock], [], [], REPLY_TIMEOUT_S)[0]:
        raise OSError(f"the warm server did not answer in {REPLY_TIMEOUT_S:.0f} s")
    msg = sock.recv(1 << 16)
    if not msg:
        raise OSError("the warm server hung up")
    return json.loads(msg)


# ---------------------------------------------------------------------------------------------
# The server's side

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
    imported = {name.partition(".")[0]: mod for name, mod in list(sys.modules.items())}
    for entry in [launch["cwd"], *_pythonpath(env, launch["cwd"])]:
        if entry in _BASE_PATH:
            continue
        for name, mod in imported.items():
            where = getattr(mod, "__file__", None) or ""
            if not where.startswith(entry + os.sep) and (
                    os.path.exists(os.path.join(entry, name, "__init__.py"))
                    or os.path.exists(os.path.join(entry, name + ".py"))):
                return f"{os.path.join(entry, name)} would shadow {name}, which it imported from {where or 'its build'}"
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
    with_stale = Path(path)
    if with_stale.is_socket():
        with_stale.unlink()
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
    from expgpu.pool.child import warm_up
    from expgpu.warm_ranks import WARM

    try:
        warm_up(WARM)
        _STAMP.update(_code_stamp())
        print(f"expgpu: warm server {os.getpid()} ready: export {ENV}={path}", file=sys.stderr, flush=True)
        _loop(listener)
    except (_Quit, KeyboardInterrupt):
        pass
    finally:
        listener.close()
        with_ours = Path(path)
        if with_ours.is_socket():
            with_ours.unlink()


def _loop(listener: socket.socket) -> None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)   # a child's exit, or a stop, wakes the select
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _quit)
    ranks: dict[socket.socket, int] = {}   # a rank's connection -> its pid
    while True:
        for ready in select.select([listener, r, *ranks], [], [])[0]:
            if ready is listener:
                _answer(listener, ranks, (r, w))
            elif ready == r:
                os.read(r, 4096)
                _reap(ranks)
            elif ready in ranks and not ready.recv(16):   # the launcher hung up first: it died
                procs.kill_group(ranks.pop(ready))
                ready.close()


def _quit(signum, frame):
    raise _Quit()


def _answer(listener: socket.socket, ranks: dict, pipe: tuple[int, int]) -> None:
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
        pid = _fork(launch, fds, [listener, conn, *ranks], pipe)
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
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for conn, rank in list(ranks.items()):
            if rank == pid:
                del ranks[conn]
                try:
                    conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()


def _fork(launch: dict, fds: list[int], socks: list, pipe: tuple[int, int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    # Stop signals stay held in the rank until its handler is in (as spawn's block_in_child).
    held = signal.pthread_sigmask(signal.SIG_BLOCK, stopping.STOP_SIGNALS)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return pid
    try:
        signal.set_wakeup_fd(-1)
        for sig, default in ((signal.SIGCHLD, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                             (signal.SIGINT, signal.default_int_handler)):
            signal.signal(sig, default)
        for sock in socks:
            sock.close()
        for own in pipe:
            os.close(own)
        os.setsid()   # its own process group, as spawn's ranks
        procs.die_with_parent(server)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(launch["cwd"])
        sys.path[:] = _job_path(launch)
        if "numpy" in sys.modules:   # a fresh process would seed it from the OS; forks share one state
            sys.modules["numpy"].random.seed()
        from expgpu.warm_ranks import run_rank

        run_rank(launch["env"], launch["argv"])
    finally:
        os._exit(1)


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print("usage: python -m expgpu.warm_server PATH   (a socket path; then export "
              f"{ENV}=PATH for the launches that should use it)", file=sys.stderr)
        sys.exit(2)
    try:
        serve(os.path.abspath(sys.argv[1]))
    except UserError as e:
        print(f"expgpu: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
