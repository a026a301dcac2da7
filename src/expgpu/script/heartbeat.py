"""A script's heartbeat: the step its expgpu.log logged last, seen by its rank's supervisor, with no I/O per call.

The rank's runner makes a 16-byte file in the temp dir (the node's own: the run dir may be on a network file
system), maps it into memory (`Heartbeat`) and names it in the script's environment (EXPGPU_SCRIPT_HEARTBEAT).
expgpu.log, in the script's own process, on every rank (rows are rank 0's only), maps it too (`Beat`) and writes
two numbers into it when the step moves: the step, then how many times it moved (the first call counts: a
reader that looks once a second still knows the script is past its first row). A store into shared memory:
no system call, nothing written out per call (the kernel writes the page back now and then, and no one reads
it there). The runner reads it once a second (expgpu.script.watch); a step that stops moving is a hang.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from typing import Mapping

from expgpu.envvars import SCRIPT_HEARTBEAT

SIZE = 16
_STEP = struct.Struct("<q")    # at 0: the last step logged
_MOVES = struct.Struct("<q")   # at 8: how many times the step moved (0: no call yet); written after the step


class Beat:
    """The script's side: what expgpu.log writes."""

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Beat | None:
        path = env.get(SCRIPT_HEARTBEAT)
        if not path:
            return None
        try:
            with open(path, "r+b") as f:
                return Beat(mmap.mmap(f.fileno(), SIZE))
        except (OSError, ValueError):   # not there (a process outside the rank's), or not a heartbeat
            return None

    def __init__(self, memory: mmap.mmap):
        self.memory = memory
        self.step = -1
        self.moves = 0

    def beat(self, step: int | None) -> None:
        """A row logged at `step` (None, or not an int: the step after the last)."""
        if not (isinstance(step, int) and not isinstance(step, bool) and -2**63 <= step < 2**63):
            step = self.step + 1
        if step == self.step and self.moves:
            return
        self.step, self.moves = step, self.moves + 1
        _STEP.pack_into(self.memory, 0, step)
        _MOVES.pack_into(self.memory, 8, self.moves)


class Heartbeat:
    """The runner's side: the file made, read, removed."""

    def __init__(self):
        fd, self.path = tempfile.mkstemp(prefix="expgpu-heartbeat-")
        try:
            os.ftruncate(fd, SIZE)
            self.memory = mmap.mmap(fd, SIZE, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def read(self) -> tuple[int, int]:
        """(moves, step): how many times the step expgpu.log logged has moved (0: never called), and the last."""
        return _MOVES.unpack_from(self.memory, 8)[0], _STEP.unpack_from(self.memory, 0)[0]

    def env(self) -> dict[str, str]:
        return {SCRIPT_HEARTBEAT: self.path}

    def close(self) -> None:
        self.memory.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
