"""The launcher's handle on a job's process (expgpu.pool.job_process), started before its job: a warm spare.

A sweep of short jobs would otherwise spend much of each slot on Python, Hydra and torch starting
up (as Ray prestarts its workers). Until it is given a job a spare runs no code of the user's
except imports, and sees no GPU (CUDA_VISIBLE_DEVICES="" on a machine with GPUs), so even a stray
CUDA call could not land on another job's card.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import sys
from pathlib import Path
from typing import Sequence

from expgpu import envvars, procs
from expgpu.gpus.mask import gpu_env
from expgpu.procs.forkserver import ForkedProc, ForkServer, start_child
from expgpu.rundir import SPARES_LOG  # noqa: F401  (the pool's modules name it from here)
from expgpu.script import is_script
from expgpu.task import RANK_IMPORTS, SCRIPT_RANK_IMPORTS, TRIAL_IMPORTS


def spare_env(hide_gpus: bool) -> dict[str, str]:
    """The environment of a process that has no job yet (a spare, the fork server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(envvars.POOL_PREFIX)}
    env[envvars.POOL_PARENT] = str(os.getpid())
    if hide_gpus:  # no GPU at all until it is told its own
        env.update(gpu_env([], os.environ.get("CUDA_DEVICE_ORDER")))
    return env


class Spare:
    """A job's process, started before its job and warming up until it gets one: a fork of the
    sweep's fork server (warm at once), or, without one, a process of its own that imports `warm`
    (and unpickles `context`) itself."""

    def __init__(self, state: Path, hide_gpus: bool, warm: Sequence[str] = (), context: Path | None = None,
                 server: ForkServer | None = None):
        self.log = state / SPARES_LOG
        if server is not None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.proc = server.fork(theirs)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
        else:
            self.proc, ours = start_child([], spare_env(hide_gpus), self.log)
        ours.setblocking(False)
        self.sock: socket.socket | None = ours
        self.ready = False
        self.job = None   # the job it is primed with (prime()), if any
        if server is None:
            self.warm(warm, context)

    def is_ready(self) -> bool:
        if not self.ready and self.sock is not None:
            try:
                self.ready = self.sock.recv(16) == b"ready"
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                pass
        return self.ready

    def alive(self) -> bool:
        return self.proc.poll() is None

    def warm(self, modules: Sequence[str], context: Path | None = None) -> None:
        """Import these too while waiting (the task's modules, known once the sweep is composed),
        from the launcher's import path (its script's directory, --config-dir task modules); and
        unpickle the sweep's context file (Hydra's context, the task function), once it exists."""
        if self.sock is not None:   # even with no modules: the path lets it scan Hydra's plugins ahead
            msg = {"warm": list(modules), "path": list(sys.path), "context": str(context) if context else None}
            try:
                self.sock.sendmsg([json.dumps(msg).encode()])
            except OSError:   # it died: the pool notices and starts another
                pass

    def prime(self, job, spec: dict) -> None:
        """Give it the job it will run next, before the job's GPUs or slot are free: it does Hydra's
        set-up of the job (run_job up to the task function, tens of ms of config copies and YAML)
        while the slot is still busy, then waits in the job's task function for give()."""
        self.sock.sendmsg([json.dumps({**spec, "prime": True}).encode()])
        self.job = job

    def give(self, spec: dict, fds: list[int]) -> None:
        """Hand over a job: its environment, output file and job file (unless primed with it), and
        its lease descriptors."""
        msg = json.dumps(spec).encode()
        if fds:
            socket.send_fds(self.sock, [msg], fds)
        else:
            self.sock.sendmsg([msg])
        # Closing with its "ready" unread would reset the connection (ECONNRESET): a process
        # already waiting for its job would get that error instead of the job sent just before.
        self.is_ready()
        self.sock.close()
        self.sock = None

    def dismiss(self) -> None:
        """No job for it after all: it holds nothing and ran nothing of anyone's, so it just goes."""
        if self.sock is not None:
            self.sock.close()   # a fork not made yet sees the launcher gone, and leaves at once
            self.sock = None
        pid = self.proc.known_pid() if isinstance(self.proc, ForkedProc) else self.proc.pid
        if pid is not None:
            procs.kill_group(pid)   # it leads its own session: its pgid is its pid
            self.proc.wait()


def primable(hydra_context, task_function, own_code: bool) -> bool:
    """Whether a spare may do Hydra's set-up of its next job before the job's hand-over (Spare.prime).

    Not with a callback that is not Hydra's or expgpu's: its on_job_start would run before the job
    has its GPUs. On real GPUs (own_code=False), only for expgpu's own app: priming unpickles the
    task function, and another app's imports the user's modules, which may start CUDA without the
    job's GPUs (task_modules says why); expgpu's imports the task's modules only after the hand-over."""
    if any(not type(cb).__module__.startswith(("hydra.", "expgpu.")) for cb in hydra_context.callbacks.callbacks):
        return False
    # expgpu's is a closure in expgpu/__main__.py (under expgpu_optuna, inside the trial check's wrapper)
    code = getattr(inspect.unwrap(task_function), "__code__", None)
    top = Path(__file__).resolve().parents[1]   # expgpu/, where __main__.py and app.py are
    return own_code or (code is not None and Path(code.co_filename).resolve().parent == top)


def task_modules(cfg, own_code: bool) -> list[str]:
    """What a job of an expgpu app imports before its first step: torch (most of a job's start-up;
    importing it starts no CUDA), expgpu's line and the modules the job's config names (_target_s
    under task: its function, or the built-in loop's model, dataset, optimizer), and Optuna with the
    trial's reporter when `cfg` is the config of a job an optimizing sweeper started as a trial.
    Nothing for another Hydra app: its spares stay as light as they were.

    own_code=False (a pool of real GPUs): only torch's and expgpu's modules. A user's module may ask
    torch.cuda.is_available() at import, which starts CUDA's driver with the spare's mask (no GPU)
    and fixes it for good, without torch.cuda.is_initialized() saying so: the job would then see
    no GPU. Imported after the hand-over, as without spares, it sees the job's GPUs."""
    from omegaconf import OmegaConf

    from expgpu import config

    if not config.is_expgpu(cfg):
        return []
    task = cfg.task
    if is_script(task):   # the job only supervises the script's own process, which imports torch itself
        return list(SCRIPT_RANK_IMPORTS)
    found: list[str] = list(RANK_IMPORTS)
    if OmegaConf.select(cfg, f"hydra.job.env_set.{envvars.TRIAL}", default=None):
        found += TRIAL_IMPORTS

    def walk(node) -> None:
        if isinstance(node, dict):
            target = node.get("_target_")
            if isinstance(target, str) and "." in target:
                module = target.rsplit(".", 1)[0]
                if own_code or module.split(".")[0] in ("torch", "expgpu"):
                    found.append(module)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(OmegaConf.to_container(task, resolve=False))
    return list(dict.fromkeys(found))
