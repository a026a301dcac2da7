"""Fork servers: a warm process that forks a process per job or rank (as multiprocessing's forkserver does).

Importing torch (and torch._dynamo, which the first optimizer pulls in) costs a process about 3
CPU-seconds: a spare per job paid it once per job, on the cores the running jobs need, where
Hydra's basic launcher pays it once per sweep. The fork server imports it all once, without
starting a thread or CUDA, and each job's process is a fork of it: warm at once, its memory
shared copy-on-write. Forking is safe because nothing here has started a Python thread, an
OpenMP pool or CUDA (checked: a server with a second Python thread refuses to fork, and the pool
falls back to spares started one by one).

Three lifetimes use it: one server per gpu_pool sweep (its jobs), one per local launch (its ranks:
expgpu.launch.warm), one shared by every launch on the machine (expgpu.launch.warm_server, which answers
on a listening socket of its own). All three import with warm_imports, wake on a child's exit with
ChildWakeups, and set a forked child up with after_fork.

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
import gc
import importlib
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
    stderr); `module`: the server's entry (the pool's jobs, or expgpu.launch.warm's ranks)."""

    def __init__(self, log: Path | None, env: dict[str, str], warm: Sequence[str],
                 module: str = "expgpu.pool.job_process", args: Sequence[str] = ("--forkserver",)):
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
                module: str = "expgpu.pool.job_process") -> tuple[subprocess.Popen, socket.socket]:
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
# The server's side

def warm_imports(modules: Sequence[str], path: Sequence[str] = ()) -> None:
    """Import what the children need before there is a child: none of it runs their code or starts
    CUDA (checked: a process whose CUDA started has its GPU mask fixed, useless for a GPU job)."""
    sys.path[:0] = [p for p in path if p not in sys.path]
    threads = None   # torch's intra-op thread count, pinned to 1 while the rest imports (below)
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:   # not importable ahead: the child imports it again and reports it where users look
                pass
            if threads is None and "torch" in sys.modules:
                # A module that runs a large torch op at import (a dataset built at module level) would
                # start torch's OpenMP pool here, and every child given more than one thread would hang
                # at its first parallel op: on one thread, an op runs inline and starts no pool.
                threads = sys.modules["torch"].get_num_threads()
                sys.modules["torch"].set_num_threads(1)
    finally:
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)   # the children's default, as before
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print(f"expgpu: fork server {os.getpid()}: CUDA was initialized while importing {', '.join(modules)}; "
              "this process cannot fork a job", flush=True)
        os._exit(3)
    # The imported modules live as long as the process: keep the collector from scanning them at
    # every collection of a child (torch and Hydra are hundreds of thousands of objects).
    gc.freeze()


class ChildWakeups:
    """A descriptor that becomes readable when a child exits (or a handled signal arrives): a server
    select()s on it beside its sockets, then reaps (procs.reaped)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.w, False)
        signal.set_wakeup_fd(self.w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def drain(self) -> None:
        os.read(self.r, 4096)


def after_fork(server: int, wakeups: ChildWakeups, close: Sequence[socket.socket] = ()) -> None:
    """In a forked child, first: nothing of the server's loop, a session of its own, death with the
    server, and fresh random state, as a process started on its own would have."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (wakeups.r, wakeups.w):
        os.close(fd)
    for sock in close:
        sock.close()
    os.setsid()   # its own process group, as a process started with start_new_session
    procs.die_with_parent(server)
    if "numpy" in sys.modules:   # a fresh process would seed it from the OS; forks share one state
        sys.modules["numpy"].random.seed()


def serve(sock: socket.socket, warm_up, spare) -> None:
    """Answer the launcher until it hangs up: `warm_up(modules, path, context)` on a "warm" request,
    `spare(sock)` in a child forked on a "fork" request."""
    wakeups = ChildWakeups()
    while True:
        ready = select.select([sock, wakeups.r], [], [])[0]
        if wakeups.r in ready:
            wakeups.drain()
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
                _fork(sock, spec["fork"], fds[0], wakeups, spare)


def _reap(sock: socket.socket) -> None:
    for pid, code in procs.reaped():
        sock.send(json.dumps({"exited": pid, "code": code}).encode())


def _fork(sock: socket.socket, request: int, fd: int, wakeups: ChildWakeups, spare) -> None:
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
            after_fork(server, wakeups, [sock])
            spare(socket.socket(fileno=fd))
        finally:
            os._exit(1)
    os.close(fd)
    sock.send(json.dumps({"forked": request, "pid": pid}).encode())
