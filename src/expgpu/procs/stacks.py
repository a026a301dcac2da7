"""Where a process is: every thread's Python stack, written for a person, and the one frame that says it.

The frame that says it is the innermost one of the user's own code (not the standard library's, a
package's or expgpu's): `hangfn.py:10 in train: time.sleep(3600)`, with what it was in beneath, if that
was Python (`in torch's _engine_run_backward`). Native frames come from py-spy when it is installed
(`pip install 'expgpu[hang]'`): a thread in C code shows only its last Python frame otherwise.

Another process (a script task's script, expgpu.script.watch) is read from outside, by py-spy only: `spy` (its
dump as text, its subprocesses' too) and `spied_frame` (the frame that says it, from its main thread). Without
py-spy nothing is read: a signal would be the script's to handle, and faulthandler is the script's own.
"""

from __future__ import annotations

import json
import linecache
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import traceback
from pathlib import Path

_EXPGPU = str(Path(__file__).resolve().parents[1])
_LIBRARIES = tuple({os.path.realpath(p) for key in ("stdlib", "platstdlib", "purelib", "platlib")
                    if (p := sysconfig.get_paths().get(key))})


def _own(filename: str) -> bool:
    """A file of the user's: not Python's, not an installed package's, not expgpu's."""
    path = os.path.realpath(filename)
    if filename.startswith("<") or path.startswith(_EXPGPU) or path.startswith(_LIBRARIES):
        return False
    return "site-packages" not in path and "dist-packages" not in path


def where(frame) -> dict:
    """The user's innermost frame of a stack (`frame`: its innermost), and the innermost one overall."""
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return _where(frames)


def _where(frames: list[tuple[str, int, str]]) -> dict:
    """where() of a stack as (filename, line, function) tuples, innermost first."""
    innermost = frames[0] if frames else None
    own = next((f for f in frames if _own(f[0])), None)

    def spelled(f) -> str:
        filename, lineno, name = f
        line = linecache.getline(filename, lineno).strip()
        at = f"{os.path.basename(filename)}:{lineno} in {name}"
        return f"{at}: {line}" if line else at

    out = {"own": spelled(own) if own is not None else None}
    if innermost is not None and innermost is not own:
        package = _package(innermost[0])
        out["inside"] = f"{package}'s {innermost[2]}" if package else innermost[2]
    return out


def _package(filename: str) -> str | None:
    """`torch` for .../site-packages/torch/autograd/graph.py; None for a file of no package."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    if os.path.realpath(filename).startswith(_EXPGPU):
        return "expgpu"
    return None


def dump(path: Path, header: str, skip: int | None = None, native_timeout_s: float = 20.0) -> dict:
    """Write every thread's stack (but thread `skip`'s: the caller's own) to `path`; the main thread's
    frame (where()), to name in one line."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    lines = [header, ""]
    for ident, frame in sorted(frames.items(), key=lambda kv: kv[0] != main):
        if ident == skip:
            continue
        lines.append(f"--- thread {names.get(ident, ident)}{' (main)' if ident == main else ''} ---")
        lines += [s.rstrip("\n") for s in traceback.format_stack(frame)]
        lines.append("")
    native = _native(native_timeout_s)
    if native:
        lines += ["--- native stacks (py-spy dump --native) ---", native]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return where(frames[main]) if main in frames else {"own": None}


def _native(timeout_s: float) -> str | None:
    """py-spy's dump of this process with native frames, where py-spy is installed and may attach."""
    return spy(os.getpid(), timeout_s)


def spy_path() -> str | None:
    """py-spy's executable: beside this Python's (a venv not activated: `.venv/bin/python -m expgpu`), else on PATH."""
    return shutil.which("py-spy", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))


def has_spy() -> bool:
    return spy_path() is not None


def spy(pid: int, timeout_s: float, subprocesses: bool = False) -> str | None:
    """py-spy's dump of process `pid` (every thread, native frames too; `subprocesses`: its children's as
    well), or why py-spy could not attach; None where py-spy is not installed."""
    spy = spy_path()
    if spy is None:
        return None
    try:
        done = subprocess.run([spy, "dump", "--native", *(["--subprocesses"] if subprocesses else []),
                               "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"(py-spy did not answer within {timeout_s:g} s)"
    except OSError as e:
        return f"(py-spy could not run: {e})"
    return done.stdout if done.returncode == 0 else f"(py-spy could not attach: {done.stderr.strip()[:300]})"


def spied_frame(pid: int, timeout_s: float) -> dict | None:
    """where() of another process's main thread, as py-spy reads it (its Python frames); None where py-spy
    is not installed or could not attach."""
    spy = spy_path()
    if spy is None:
        return None
    try:
        done = subprocess.run([spy, "dump", "--json", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=timeout_s)
        threads = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return frame_of_dump(threads, pid)


def frame_of_dump(threads, pid: int) -> dict | None:
    """where() of the main thread in py-spy's `dump --json` ([{thread_name, os_thread_id, frames: [{filename,
    line, name}, ...]}, ...], innermost frame first), by its name or its thread id (the pid); None: none."""
    if not isinstance(threads, list):
        return None
    main = next((t for t in threads if isinstance(t, dict) and t.get("thread_name") == "MainThread"), None) or \
        next((t for t in threads if isinstance(t, dict) and t.get("os_thread_id") == pid), None)
    if main is None:
        return None
    frames = [(f.get("filename") or "?", int(f.get("line") or 0), str(f.get("name") or "?"))
              for f in main.get("frames") or [] if isinstance(f, dict)]
    return _where(frames)
