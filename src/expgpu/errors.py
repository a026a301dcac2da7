"""User-facing errors: one line, exit code 2, never a traceback."""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
import sys

from expgpu.results import is_script


class UserError(Exception):
    """Bad input from the user (config value, environment variable, GPU id, cluster setting).

    The message is one line that names what is wrong and what is allowed; the entry point
    prints it as ``expgpu: error: <message>`` and exits with EXIT_USER_ERROR.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # always one line


class RunDirBusy(UserError):
    """Another run is in progress in this run dir (expgpu.status.busy): nothing of this one may be written there,
    not even its failure record."""


def shown(value) -> str:
    """A value as a refusal names it: as the command line writes it (true, false, null; an enum by its name),
    else Python's repr (a string quoted, so that '' and ' 1' show)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return value.name if isinstance(value, enum.Enum) else repr(value)


EXIT_USER_ERROR = 2
EXIT_HUNG = 124   # a run the hang watchdog ended (GNU timeout's code for "timed out"); a crash exits 1
# A rank its watchdog ended because a peer's task raised (expgpu.train.watchdog): an echo of the peer's failure,
# which a supervisor names instead (expgpu.launch.spawn)
EXIT_PEER_FAILED = 113


def no_room(e: BaseException) -> bool:
    """A write that failed for want of room or of a writable disk (ENOSPC, EDQUOT, EROFS): the machine's state,
    not a bug: one line, no traceback (what was written before it stays: expgpu.rundir.atomic_write_bytes)."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


# What gloo and NCCL say when a peer of a collective is gone (its process ended, or its group was torn down)
_LOST_PEER = ("closed by peer", "reset by peer", "broken pipe", "remote process exited", "communicator was aborted")


def lost_peer(e: BaseException) -> bool:
    """An error of a collective whose peer went away: most often the echo of that peer's own end, not a
    cause (torch.distributed's DistNetworkError, or gloo's and NCCL's words for it)."""
    return type(e).__name__ == "DistNetworkError" or any(w in str(e).lower() for w in _LOST_PEER)


# What gloo, NCCL and the store say when a collective or a store's wait ran past the process group's timeout
_TIMED_OUT = ("timed out waiting", "collective operation timeout", "failed to pass monitoredbarrier",
              "wait timeout after")


def timed_out(e: BaseException) -> bool:
    """An error of a collective that waited for a peer past backend.timeout_s: the rank that raised it waited,
    the one it waited for is the cause (expgpu.train.watchdog.Watchdog.held_up says which)."""
    return any(w in str(e).lower() for w in _TIMED_OUT)


# torch.distributed's words in an error of a collective or of its store: its backends' file paths and names (gloo's
# pair.cc, NCCL's ProcessGroupNCCL.cpp), its exception classes
_COLLECTIVE = re.compile(r"gloo|nccl|c10d|ProcessGroup|Dist\w*Error", re.IGNORECASE)


def collective_error(line: str) -> bool:
    """A line in which torch.distributed says a collective (or its store) lost its peer or timed out, as a
    script's stderr shows it (gloo's RuntimeError, NCCL's watchdog line before its abort): not an error of the
    script's own connections in the same words (an upload's 'Connection reset by peer')."""
    low = line.lower()
    said = "distnetworkerror" in low or any(w in low for w in _LOST_PEER + _TIMED_OUT)
    return said and bool(_COLLECTIVE.search(line))


def no_room_line(e: OSError) -> str:
    """What a no_room error says, wherever it ends the run (this process, or a rank's supervisor)."""
    return (f"could not write {e.filename or 'a file of the run'}: {e.strerror}; what was written before it (the last "
            "checkpoint) is kept: make room there, or give the run another hydra.run.dir, and rerun to resume")


# The sweep dir this process claimed (expgpu.status.busy.RunDirGuard) and this process's pid: a user error that ends
# the sweep is recorded there too (its .expgpu/failure.json), so that `expgpu status` says why a sweep ended before
# its first job instead of showing it empty. Not in the job processes a sweep forks, which have their own dirs.
_sweep: tuple[int, object] | None = None


def record_in(sweep) -> None:
    global _sweep
    _sweep = (os.getpid(), sweep)


def said(line: str) -> None:
    """A user error that ends this process, printed: recorded in the sweep dir it claimed, if any."""
    if _sweep is None or _sweep[0] != os.getpid():
        return
    from expgpu.results import write_job_failure

    try:
        write_job_failure(_sweep[1], line, user_error=True)
    except OSError:
        pass   # the line on stderr is what counts


@contextlib.contextmanager
def exit_on_user_error():
    """Around what Hydra calls inside any app (a launcher's launch()): a UserError ends the process as
    expgpu's CLI ends it, `expgpu: error: <message>` and exit code 2, where another app's @hydra.main
    would print Hydra's report with a traceback and exit 1 (SystemExit passes through run_and_report)."""
    try:
        yield
    except UserError as e:
        said(str(e))
        print(f"expgpu: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


def stdout_gone() -> None:
    """The reader of this process's output left before the end (`expgpu status | head`): from now on what it
    prints goes to /dev/null, as Python's docs advise (else the flush at exit raises BrokenPipeError again).
    The command then ends quietly, with no traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none)."""
    text = str(e).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(e).__name__


def short(text: str) -> str:
    """gloo's words without its source path and advice: 'Read error [10.0.0.2]:43124: Connection reset by peer'."""
    text = re.sub(r"^(\w+: )?\[[^\]]*\.(cc|cpp|h):\d+\]\s*", r"\1", text)
    return text.split(". This is typically")[0][:160]


def plural(n: int, word: str) -> str:
    """'1 job', '2 jobs': a count in a message."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def env_int(env, name: str, *, minimum: int = 0) -> int:
    """Read an integer environment variable, naming it when it is malformed."""
    raw = env.get(name)
    if raw is None:
        raise UserError(f"environment variable {name} is not set")
    # int() alone would also take "1_0" and non-ASCII digits, which no launcher writes
    if not re.fullmatch(r"-?[0-9]+", raw.strip()):
        raise UserError(f"environment variable {name}={raw!r} is not an integer (must be an integer >= {minimum})")
    value = int(raw)
    if value < minimum:
        raise UserError(f"environment variable {name}={raw!r} must be >= {minimum}")
    return value


def one_line(e: BaseException) -> str:
    """An exception as one line with its type: "OSError: [Errno 28] No space left on device"."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# Outcomes of a run that are not user errors: the CLI prints each as one line with its own exit
# code. Here, not in app.py, because every launcher raises or reports them (spawn, gpu_pool, SLURM).

def _restore(cls: type, args: tuple, state: dict) -> Exception:
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


class _Outcome(Exception):
    def __reduce__(self):
        # A launcher that runs jobs in worker processes (Hydra's joblib) pickles the job's exception
        # back to the sweep: Exception's default would call cls(message), which these __init__s refuse.
        return (_restore, (type(self), self.args, self.__dict__))


class Stopped(_Outcome):
    """Training stopped early on a signal; the checkpoint in the run dir resumes it."""

    def __init__(self, result: dict, exit_code: int = 143, next_step: str = ""):
        sig = result.get("stop_signal") or "a signal"
        if is_script(result):   # a script task: its checkpoints, if any, are its own
            next_step = next_step or (f"Rerun with the same overrides plus hydra.run.dir={result['run_dir']}: "
                                      "the script starts again there, with task.resume_args where they apply")
            codes = ",".join("?" if c is None else str(c) for c in result["exit_codes"])
            super().__init__(f"the script stopped on {sig} (exit code{'s' if len(result['exit_codes']) > 1 else ''} "
                             f"{codes}). {next_step}")
        else:
            next_step = next_step or (f"Resume with the same overrides plus hydra.run.dir={result['run_dir']}")
            of = f" of {result['max_steps']}" if result.get("max_steps") is not None else ""
            super().__init__(f"stopped at step {result['steps']}{of} by {sig}; checkpoint saved. {next_step}")
        self.result = result
        self.exit_code = exit_code  # 128 + the signal: 130 Ctrl-C, 143 SIGTERM, 140 SIGUSR2


class Hung(_Outcome):
    """The run hung: the watchdog named the rank(s) at fault, wrote every rank's stacks, ended them all."""

    def __init__(self, line: str, stacks: str, text: str | None = None):
        # text: the whole line instead, where it says more (expgpu.launch.restarts: hung again, not restarted)
        super().__init__(text or f"hung: {line} (every rank's stacks: {stacks})")
        self.exit_code = EXIT_HUNG


class PeerLost(_Outcome):
    """A rank of srun's or torchrun's (no expgpu supervisor) whose collective lost a peer: the echo of that
    peer's end, said in one line naming it where it can (expgpu.launch.failures.echo_of), not a traceback."""

    def __init__(self, line: str):
        super().__init__(line)
        self.exit_code = EXIT_PEER_FAILED


class WorkerFailed(_Outcome):
    """A worker (a rank, or a sweep's job) failed: shown as `expgpu: <message>`, exit code 1.

    `failure`: expgpu.results.Failure for a rank (its rank, message, exit code), None for a job."""

    def __init__(self, failure, text: str | None = None):
        # text: the whole line instead, where it says more (expgpu.launch.restarts: failed again, not restarted)
        super().__init__(text or f"rank {failure.rank} failed: {failure.message}")
        self.failure = failure
