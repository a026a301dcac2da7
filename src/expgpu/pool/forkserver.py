"""One warm process per sweep that forks a process per job (as multiprocessing's forkserver does).

Importing torch (and torch._dynamo, which the first optimizer pulls in) costs a process about 3
CPU-seconds: a spare per job paid it once per job, on the cores the running jobs need, where
Hydra's basic launcher pays it once per sweep. The fork server imports it all once, without
starting a thread or CUDA, and each job's process is a fork of it: warm at once, its memory
shared copy-on-write. Forking is safe because nothing here has started a Python thread, an
OpenMP pool or CUDA (checked: a server with a second Python thread refuses to fork, and the pool
falls back to spares started one by one).

The launcher's side (ForkServer, ForkedProc) and the server's (serve) share one SEQPACKET socket:
    launcher -> server  {"warm": modules, "path": sys.path, "context": file}   import, unpickle
                        {"fork": n} + a socket end (SCM_RIGHTS)               fork a spare on it
    server -> launcher  {"forked": n, "pid": pid}  {"exited": pid, "code": exit code as Popen's}
The server reaps its children and reports their exit codes (the launcher is not their parent).
It waits for requests without a time limit: it dies with the launcher (PR_SET_PDEATHSIG) and
leaves when the launcher closes the socket; its children die with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from expgpu import procs

REPLY_TIMEOUT_S = 120.0   # for a fork, the server may first finish importing torch on busy cores


class ForkServer:
    """`log`: where the server's and its children's output goes (None: this process's stdout and
    stderr); `module`: the server's entry (the pool's jobs, or expgpu.warm_ranks' ranks)."""

    def __init__(self, log: Path | None, env: dict[str, str], warm: Sequence[str], module: str = "expgpu.pool.child",
                 args: Sequence[str] = ("--forkserver",)):
        self.proc, self.sock = start_child(list(args), env, log, module)
        self.pids: dict[int, int] = {}    # fork request -> pid
        self.codes: dict[int, int] = {}   # pid -> exit code
        self._next = 0
        self.warm(warm)

    def alive(self) -> bool:
        return self.sock is not None and self.proc.poll() is None

    def _send(self, msg: dict, fds: Sequence[int] = ()) -> None:
        try:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], list(fds))
        except OSError as e:
            raise OSError(f"the pool's fork server is gone ({e})") from None

    def warm(self, modules: Sequence[str], context: Path | None = None) -> None:
        self._send({"warm": list(modules), "path": list(sys.path), "context": str(context) if context else None})

    def fork(self, their_end: socket.socket) -> "ForkedProc":
        """A new process on `their_end` (its pid comes later: ForkedProc.pid waits for it)."""
        self._next += 1
        self._send({"fork": self._next}, [their_end.fileno()])
        return ForkedProc(self, self._next)

    def pump(self, timeout: float = 0.0) -> None:
        """Read what the server said (forks, exits), waiting up to `timeout` for the first word."""
        while self.sock is not None:
            if not select.select([self.sock], [], [], timeout)[0]:
                return
            timeout = 0.0
            try:
                msg = self.sock.recv(4096)
            except OSError:
                msg = b""
            if not msg:   # the server is gone: its children died with it
                self.close()
                return
            info = json.loads(msg)
            if "forked" in info:
                self.pids[info["forked"]] = info["pid"]
            else:
                self.codes[info["exited"]] = info["code"]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        procs.kill_group(self.proc.pid)
        self.proc.wait()


def start_child(args: list[str], env: dict[str, str], log: Path | None,
                module: str = "expgpu.pool.child") -> tuple[subprocess.Popen, socket.socket]:
    """`python -m MODULE ARGS FD` in a session of its own, output to `log` (None: this process's),
    and the launcher's end of its socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with (open(log, "ab") if log is not None else contextlib.nullcontext()) as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args, str(theirs.fileno())], env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None,
                start_new_session=True, pass_fds=[theirs.fileno()])
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


class ForkedProc:
    """A forked job process, as much of subprocess.Popen as the pool uses (pid, poll, wait)."""

    def __init__(self, server: ForkServer, request: int):
        self.server, self.request = server, request

    @property
    def pid(self) -> int:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while self.request not in self.server.pids:
            if not self.server.alive() or time.monotonic() > deadline:
                raise OSError("the pool's fork server did not start a process for the job")
            self.server.pump(0.1)
        return self.server.pids[self.request]

    def known_pid(self) -> int | None:
        self.server.pump()
        return self.server.pids.get(self.request)

    def poll(self) -> int | None:
        self.server.pump()
        pid = self.server.pids.get(self.request)
        if pid is None:
            return None if self.server.alive() else -signal.SIGKILL
        if pid not in self.server.codes and not self.server.alive():
            return -signal.SIGKILL   # died with the server, unreported
        return self.server.codes.get(pid)

    def wait(self, timeout: float = 30.0) -> int | None:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < deadline:
            self.server.pump(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        """As Popen's: not to a process known to have exited. Reads nothing from the server (it may
        run in a signal handler, between the launcher's select and its read of the same socket)."""
        pid = self.server.pids.get(self.request)
        if pid is not None and pid not in self.server.codes:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# The server's side (in `python -m expgpu.pool.child --forkserver FD`)

def serve(sock: socket.socket, warm_up, spare) -> None:
    """Answer the launcher until it hangs up; `spare(sock)` is what a forked child runs."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)                                   # a child's exit wakes the select
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready = select.select([sock, r], [], [])[0]
        if r in ready:
            os.read(r, 4096)
            _reap(sock)
        if sock in ready:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
            except OSError:
                msg, fds = b"", []
            if not msg:
                os._exit(0)
            spec = json.loads(msg)
            if "warm" in spec:
                warm_up(spec["warm"], spec["path"], spec.get("context"))
            elif "fork" in spec:
                _fork(sock, spec["fork"], fds[0], (r, w), spare)


def _reap(sock: socket.socket) -> None:
    for pid, code in procs.reaped():
        sock.send(json.dumps({"exited": pid, "code": code}).encode())


def _fork(sock: socket.socket, request: int, fd: int, pipe: tuple[int, int], spare) -> None:
    import threading

    if threading.active_count() > 1:   # a Python thread (an import started one) would be missing,
        # maybe holding a lock, in the child. Native threads are not counted: OpenBLAS starts its pool
        # when torch loads and stops it across a fork (pthread_atfork); OpenMP's starts at the first
        # parallel op, which the server never runs.
        print(f"expgpu: fork server: {threading.active_count()} threads, not forking; the pool starts "
              "processes one by one", flush=True)
        os._exit(4)
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for own in pipe:
                os.close(own)
            sock.close()
            os.setsid()   # its own process group, as a spare started with start_new_session
            procs.die_with_parent(server)
            if "numpy" in sys.modules:   # a fresh process would seed it from the OS; forks share one state
                sys.modules["numpy"].random.seed()
            spare(socket.socket(fileno=fd))
        finally:
            os._exit(1)
    os.close(fd)
    sock.send(json.dumps({"forked": request, "pid": pid}).encode())
