"""The launcher's side of expgpu.launch.warm_server: a connection per rank, which the rank's exit code
comes back on, and which, closed while the rank runs (this process died), ends it.

expgpu.launch.spawn uses it when EXPGPU_WARM_SERVER names a server: WarmServer() checks that the server
can stand in for this launch (else Refused, and spawn starts the ranks without it), then
start() forks each rank there, on this process's stdin, stdout and stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import time

from expgpu import envvars
from expgpu.errors import UserError

ENV = envvars.WARM_SERVER
REPLY_TIMEOUT_S = 120.0   # the server may still be importing torch when the first launch asks


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
            with _stdio() as fds:
                socket.send_fds(sock, [json.dumps({"job": _launch(env, argv)}).encode()], fds)
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
    """A forked rank, as much of subprocess.Popen as expgpu.launch.spawn uses (pid, poll, wait, signals)."""

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


@contextlib.contextmanager
def _stdio():
    """This process's stdin, stdout and stderr, for a rank to inherit; /dev/null for one closed."""
    opened = []
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            opened.append(os.open(os.devnull, os.O_RDWR))
            fds.append(opened[-1])
    try:
        yield fds
    finally:
        for fd in opened:
            os.close(fd)


def _launch(env: dict[str, str], argv: list[str]) -> dict:
    return {"python": sys.executable, "cwd": os.getcwd(), "env": env, "argv": argv}


def _reply(sock: socket.socket) -> dict:
    if not select.select([sock], [], [], REPLY_TIMEOUT_S)[0]:
        raise OSError(f"the warm server did not answer in {REPLY_TIMEOUT_S:.0f} s")
    msg = sock.recv(1 << 16)
    if not msg:
        raise OSError("the warm server hung up")
    return json.loads(msg)
