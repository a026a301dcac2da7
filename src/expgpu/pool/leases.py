"""GPU leases shared by every expgpu sweep of this machine: one lock file per GPU.

A lease is an flock(2) on LEASE_DIR/<host>.<gpu uuid>.lock. The kernel drops an flock when the
last descriptor of its open file description closes, i.e. when the processes holding it are gone,
however they went (SIGKILL, OOM killer, segfault). So a lease never outlives its holder, a dead
holder's lease is free at once, and there is nothing to clean up: the file's text (who took it,
when) is only there for people and for "waiting for GPU 2, leased by pid 4711" messages.

Who holds it. The pool takes the lock (so two sweeps never pick the same GPU), passes that
descriptor to the job's process (over a Unix socket, SCM_RIGHTS; or inherited, subprocess
pass_fds), then closes its own copy: from then on the *job* holds the lease, and the GPU is free
exactly when the job's process, and any child that inherited the descriptor (forked DataLoader
workers), has exited. Were the launcher the holder, a killed
launcher would free GPUs its jobs may still be using; were the job to lock for itself, two sweeps
could start jobs on one GPU before either job got to lock it.

Two rules follow from flock semantics:
- never flock(LOCK_UN) a descriptor once handed over: it would unlock it for the job too, only
  close() our copy (which is why this is fcntl.flock and not the filelock package, whose
  release() unlocks);
- never delete a lock file: a new file under the same name would be a second, independent lock.

A share of a GPU (hydra.launcher.jobs_per_gpu, expgpu.pool.sharing) holds the GPU's lock file shared
(LOCK_SH) and its share's own file (<host>.<uuid>.share<k>.lock) exclusive: a whole-GPU lease waits for every
share of the card, and sharers wait only for their share's holder. Sweeps that share a card with different
jobs_per_gpu keep to the smallest: a share is taken only while the card's held shares are fewer than its own
N and every holder's (each share file says its holder's N, `of`), counted under the card's admission lock
(<host>.<uuid>.admit.lock, held for the count only) so that two sweeps never count at once.

Locks are keyed by GPU UUID (unique per card, whatever CUDA_VISIBLE_DEVICES renumbers) and host
(simulated GPUs share UUIDs across machines), so a lease dir on a shared home directory is fine.
flock on NFS works across clients on Linux (emulated with POSIX locks) and also dies with its holder.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from expgpu import envvars
from expgpu.errors import UserError
from expgpu.gpus.inventory import Gpu
from expgpu.pool import sharing

ENV_DIR = envvars.LEASE_DIR
ADMIT_TIMEOUT_S = 2.0   # the longest a share waits for the card's admission lock (held for a count only)


def lease_dir(configured: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """hydra.launcher.lease_dir, else $EXPGPU_LEASE_DIR, else ~/.cache/expgpu/leases.

    Every sweep that should respect the others' leases must use the same directory; it is per user
    by default. Users sharing a workstation point EXPGPU_LEASE_DIR at one shared directory.
    """
    env = os.environ if env is None else env
    raw = configured or env.get(ENV_DIR)
    if raw:
        where = "hydra.launcher.lease_dir" if configured else ENV_DIR
    else:
        cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        raw, where = os.path.join(cache, "expgpu", "leases"), "the default lease dir"
    path = Path(raw).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{where}={str(path)!r}: cannot create it ({e.strerror}); "
                        f"set {ENV_DIR} to a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{where}={str(path)!r}: not writable; set {ENV_DIR} to a writable directory")
    return path


def lock_path(directory: Path, gpu: Gpu, suffix: str = "") -> Path:
    """The GPU's lock file; a share's own (expgpu.pool.sharing) beside it; `suffix`: another of the card's."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu.uuid or f"index{gpu.index}")
    share = f".share{gpu.share}" if sharing.is_share(gpu) else suffix
    return directory / f"{socket.gethostname()}.{safe}{share}.lock"


def _share_files(directory: Path, gpu: Gpu) -> list[Path]:
    """Every share file of `gpu`'s card, of whatever jobs_per_gpu made it."""
    return list(directory.glob(lock_path(directory, sharing.card(gpu), ".share*").name))


@dataclass
class Lease:
    """A held lock on one GPU (or share of one). `fd` is ours until handed to a job (then only the job's);
    `card_fd`: a share's shared lock on the GPU's own file, handed over with it."""

    gpu: Gpu
    path: Path
    fd: int | None
    card_fd: int | None = None

    @property
    def fds(self) -> list[int]:
        return [fd for fd in (self.fd, self.card_fd) if fd is not None]

    def note(self, **holder) -> None:
        """Record who holds it (for people: the lock itself is the truth), and a share's N (`of`: what sharers
        of the card with another N keep to, expgpu.pool.sharing)."""
        if self.fd is None:
            return
        of = {"of": self.gpu.of} if sharing.is_share(self.gpu) else {}   # its N, which sharers keep to
        text = json.dumps({"gpu": self.gpu.index, "uuid": self.gpu.uuid, "host": socket.gethostname(),
                           "since": round(time.time(), 3), **of, **holder}).encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text + b"\n", 0)
        except OSError:
            pass  # a read-only lock file (another user's): the lease holds all the same

    def release(self) -> None:
        """Give the GPU back before any job got it."""
        for fd in self.fds:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.fd = self.card_fd = None

    def handed_over(self) -> None:
        """The job inherited the descriptors: close our copies only (the job keeps the locks)."""
        for fd in self.fds:
            os.close(fd)
        self.fd = self.card_fd = None


def _open(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # flock needs no write access
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o666)  # let other users of a shared lease dir lock it too
    except OSError:
        pass
    return fd


def try_acquire(directory: Path, gpu: Gpu) -> Lease | None:
    """The lease on `gpu` (or a share of it) if nobody holds it; never waits."""
    if sharing.is_share(gpu):   # the card shared with its other sharers, then the share alone
        return _try_share(directory, gpu)
    path = lock_path(directory, gpu)
    fd = _lock(path, fcntl.LOCK_EX)
    return None if fd is None else Lease(gpu, path, fd)


def _try_share(directory: Path, gpu: Gpu) -> Lease | None:
    card_fd = _lock(lock_path(directory, sharing.card(gpu)), fcntl.LOCK_SH)
    if card_fd is None:
        return None
    admit = _open(lock_path(directory, sharing.card(gpu), ".admit"))
    try:
        if not _wait_lock(admit, ADMIT_TIMEOUT_S):   # a sharer stopped mid-count (^Z): no room now, ask again later
            os.close(card_fd)
            return None
        path = lock_path(directory, gpu)
        fd = _lock(path, fcntl.LOCK_EX)
        if fd is not None and _room(directory, gpu, path):
            lease = Lease(gpu, path, fd, card_fd)
            lease.note()   # its N, for the next sharer's count, before the admission lock goes
            return lease
        for held in (fd, card_fd):
            if held is not None:
                os.close(held)
        return None
    finally:
        os.close(admit)


def _wait_lock(fd: int, timeout_s: float) -> bool:
    """LOCK_EX on `fd` within `timeout_s` (its holders hold it for microseconds, and die without it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                return False
            time.sleep(0.001)


def _room(directory: Path, gpu: Gpu, mine: Path) -> bool:
    """Whether the card has room for this share: fewer shares held than the smallest N (its own, the holders')."""
    held = [_note(path).get("of") for path in _held_shares(directory, gpu, {mine.name})]
    ns = [n for n in held if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return len(held) + 1 <= min([gpu.of, *ns])


def _held_shares(directory: Path, gpu: Gpu, but: set[str]) -> list[Path]:
    """The share files of `gpu`'s card (of whatever jobs_per_gpu made them) that someone holds, other than those
    named in `but`: each tried without waiting, and let go."""
    held = []
    for path in _share_files(directory, gpu):
        if path.name in but:
            continue
        fd = _lock(path, fcntl.LOCK_EX)
        if fd is None:
            held.append(path)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    return held


def _lock(path: Path, how: int) -> int | None:
    fd = _open(path)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def acquire_free(directory: Path, gpus: Iterable[Gpu]) -> list[Lease]:
    """Leases on every GPU of `gpus` that nobody holds now (in the order given)."""
    out = []
    for gpu in gpus:
        lease = try_acquire(directory, gpu)
        if lease is not None:
            out.append(lease)
    return out


def shared_elsewhere(directory: Path, gpu: Gpu, mine: Iterable[int]) -> bool:
    """Whether an expgpu job (of any sweep) holds a share of `gpu`'s card other than the shares `mine` (held
    here). For a GPU leased whole, never: its lease is exclusive."""
    if not sharing.is_share(gpu):
        return False
    return bool(_held_shares(directory, gpu, {lock_path(directory, dataclasses.replace(gpu, share=k)).name
                                              for k in mine}))


def release_all(leases: Sequence[Lease]) -> None:
    for lease in leases:
        lease.release()


def noted(directory: Path, gpu: Gpu) -> dict:
    """What the lock file says about its last holder (without taking the lock); for a share, the newer of its
    own file's word and its card's (a sweep without sharing may hold the whole card)."""
    if sharing.is_share(gpu):
        return max((_note(lock_path(directory, g)) for g in (sharing.card(gpu), gpu)), key=_since)   # a tie: the card
    return _note(lock_path(directory, gpu))


def _since(note: dict) -> float:
    since = note.get("since")
    return since if isinstance(since, (int, float)) else 0.0


def _note(path: Path) -> dict:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    return info if isinstance(info, dict) else {}


def holder(directory: Path, gpu: Gpu) -> dict | None:
    """Who holds the lease on `gpu` now (what the file says), or None when it is free."""
    lease = try_acquire(directory, gpu)
    if lease is not None:
        lease.release()
        return None
    return noted(directory, gpu)


def describe_holder(info: dict | None) -> str:
    if not info:
        return "free"
    pid = info.get("pid")
    what = f"pid {pid}" if pid else "another process"
    if info.get("sweep"):
        what += f" (job #{info.get('job')} of {info['sweep']})"
    elif info.get("run"):   # a run started by hand (expgpu.launch.run_leases)
        what += f" (the run in {info['run']})"
    return what
