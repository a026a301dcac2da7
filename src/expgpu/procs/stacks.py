"""Where a process is: every thread's Python stack, written for a person, and the one frame that says it.

The frame that says it is the innermost one of the user's own code (not the standard library's, a
package's or expgpu's): `hangfn.py:10 in train: time.sleep(3600)`, with what it was in beneath, if that
was Python (`in torch's _engine_run_backward`). Native frames come from py-spy when it is installed
(`pip install 'expgpu[hang]'`): a thread in C code shows only its last Python frame otherwise.
"""

from __future__ import annotations

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
        frames.append(frame)
        frame = frame.f_back
    innermost = frames[0] if frames else None
    own = next((f for f in frames if _own(f.f_code.co_filename)), None)

    def spelled(f) -> str:
        line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
        at = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"
        return f"{at}: {line}" if line else at

    out = {"own": spelled(own) if own is not None else None}
    if innermost is not None and innermost is not own:
        package = _package(innermost.f_code.co_filename)
        out["inside"] = f"{package}'s {innermost.f_code.co_name}" if package else innermost.f_code.co_name
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
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    try:
        done = subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())], capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else f"(py-spy could not attach: {done.stderr.strip()[:300]})"
