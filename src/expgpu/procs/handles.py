"""The two small contracts every launcher's process code meets, however its processes were started.

A ProcHandle is a process a launcher started and watches: subprocess.Popen (started fresh), a
ForkedProc (forked by a fork server: expgpu.procs.forkserver), a RemoteRank (forked by the warm
server, its exit code coming back on a socket: expgpu.launch.warm_client). A RankStarter starts ranks
as ProcHandles: WarmRanks (this launch's fork server) or WarmServer (the machine's); expgpu.launch.spawn
takes either, or starts ranks fresh.
"""

from __future__ import annotations

from typing import Protocol


class ProcHandle(Protocol):
    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None:
        """The exit code as Popen's (negative: killed by that signal), None while it runs."""

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, waiting up to `timeout` (None when it still runs then, or Popen's TimeoutExpired)."""

    def send_signal(self, sig: int) -> None:
        """As Popen's: not to a process known to have exited."""

    def kill(self) -> None: ...


class RankStarter(Protocol):
    def start(self, env: dict[str, str], argv: list[str]) -> ProcHandle:
        """A rank with this environment and sys.argv (OSError: it could not start one; start it fresh)."""

    def close(self) -> None: ...
