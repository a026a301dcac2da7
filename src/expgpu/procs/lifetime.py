"""A child process's lifetime: it dies with its launcher, its process group goes with it, its exit is
seen at once, and it leaves fast without skipping the user's atexit handlers.

- die_with_parent(): a child that outlives its launcher would keep GPUs, leases and CPU busy;
- kill_group(): jobs and workers lead their own process group, so whatever they forked goes too;
- reaped() / exit_fd(): a launcher learns of an exit the moment it happens;
- fast_exit(): skip interpreter shutdown, but not the user's atexit handlers.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import math
import os
import signal
import sys
import threading
import weakref
from typing import Mapping

from expgpu import envvars
from expgpu.errors import UserError

# How long atexit handlers may run in fast_exit() before the process exits anyway; a handler still
# running then is named on stderr. EXPGPU_ATEXIT_GRACE_S overrides it (seconds).
ATEXIT_GRACE_S = 10.0
ENV_ATEXIT_GRACE = envvars.ATEXIT_GRACE_S


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG).

    `parent`: the pid this process expects as its parent; if that one died before the request was
    made, the request would never fire, so exit now. Elsewhere (not Linux) this does nothing: the
    launcher's process-group kill is all there is.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(137)


def reaped():
    """(pid, exit code as Popen's) of each child that has exited, reaped without waiting."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal the process group that `pid` leads (started with start_new_session=True)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_fd(pid: int) -> int | None:
    """A descriptor that becomes readable when process `pid` exits (Linux >= 5.3), or None: a
    launcher select()s on it to refill a slot the moment its job ends, not a poll interval later."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def atexit_grace_s(env: Mapping[str, str] | None = None) -> float:
    """EXPGPU_ATEXIT_GRACE_S, or the default; a bad value is a UserError. Launchers call this
    before they start anything, so a typo is one line then, not a surprise at each job's exit."""
    raw = (os.environ if env is None else env).get(ENV_ATEXIT_GRACE)
    if raw is None or raw == "":
        return ATEXIT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise UserError(f"{ENV_ATEXIT_GRACE}={raw!r} is not allowed: seconds >= 0 that atexit handlers may run "
                        f"at a job's exit (default {ATEXIT_GRACE_S:g}); unset it or fix it")
    return value


def fast_exit(code: int, grace_s: float | None = None) -> None:
    """Exit now with `code`: run the atexit handlers (the user's flush W&B, close files and write
    summaries there; logging's own flushes the log files), flush stdout/stderr, then os._exit.

    Interpreter shutdown is skipped: for a process that loaded torch and Hydra it costs tens of
    milliseconds of every job's slot, and a gloo thread still alive after the process group is gone
    can abort it (expgpu.distributed.group). A handler that has not returned after `grace_s` is named on stderr
    and the process exits anyway: a hung flush must not hold a GPU and a pool slot for ever.
    """
    if grace_s is None:
        try:
            grace_s = atexit_grace_s()
        except UserError:   # checked when the launcher started; an exit path must not raise
            grace_s = ATEXIT_GRACE_S
    grace = grace_s
    done = threading.Event()
    caller = sys._getframe()
    main = threading.get_ident()

    def watchdog() -> None:
        if done.wait(grace):
            return
        frame = sys._current_frames().get(main)
        print(f"expgpu: atexit handler {_running_handler(frame, caller.f_code)} did not return within "
              f"{grace:g}s ({ENV_ATEXIT_GRACE}); exiting without it", file=sys.stderr, flush=True)
        _flush()
        os._exit(code)

    threading.Thread(target=watchdog, name="expgpu-atexit-watchdog", daemon=True).start()
    try:
        _skip_torch_library_finalizers()
        atexit._run_exitfuncs()   # the registered handlers, last registered first, as at a normal exit
    finally:
        done.set()
        logging.shutdown()
        _flush()
        os._exit(code)


def _skip_torch_library_finalizers() -> None:
    """Keep torch's op libraries from deregistering their kernels at exit: each torch.library.Library
    does so in a weakref.finalize that runs at exit (~1,000 once torch._dynamo is imported: ~25 ms of
    every job's slot), tidying a dispatcher that os._exit is about to drop. The user's own finalizers
    (a TemporaryDirectory's removal) still run."""
    library = sys.modules.get("torch.library")
    deregister = getattr(library, "_del_library", None)
    if deregister is None:
        return
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):   # the live ones (CPython's)
        info = finalizer.peek()
        if info is not None and info[1] is deregister:
            finalizer.atexit = False


def _running_handler(frame, fast_exit_code) -> str:
    """The atexit handler the main thread is in: the frame just below fast_exit's own."""
    while frame is not None:
        back = frame.f_back
        if back is not None and back.f_code is fast_exit_code:
            co = frame.f_code
            name = getattr(co, "co_qualname", co.co_name)
            module = frame.f_globals.get("__name__", "?")
            return f"{module}.{name} ({co.co_filename}:{co.co_firstlineno})"
        frame = back
    return "(one without Python code)"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
