"""The CPU threads a process may use when several share the cores (spawn's ranks, gpu_pool's jobs)."""

from __future__ import annotations

import os
import re
from typing import Mapping

from expgpu.errors import UserError

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")   # torch's: a value the user set decides
# numpy's OpenBLAS (scikit-learn, a user's data code) also starts a thread per core; a value the
# user set for it alone is kept, and does not stand for torch's.
BLAS_VAR = "OPENBLAS_NUM_THREADS"


def cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a cgroup cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def user_threads(env: Mapping[str, str] | None = None) -> str | None:
    """The thread-count variable the user set (e.g. "OMP_NUM_THREADS=4"), or None; one line (UserError) for
    a value OpenMP would refuse (libgomp only warns, and runs with a thread per core)."""
    env = os.environ if env is None else env
    found = None
    for name in THREAD_VARS:
        value = env.get(name)
        if value and not re.fullmatch(r"\s*[1-9]\d*(\s*,\s*[1-9]\d*)*\s*", value):
            raise UserError(f"environment variable {name}={value!r} is not allowed: a number of threads >= 1 "
                            f"(OpenMP's nested list too, e.g. 4,2); or unset it, and expgpu shares the cores out "
                            "among the processes")
        found = found or (f"{name}={value}" if value else None)
    return found


def threads_env(threads: int) -> dict[str, str]:
    """OMP/MKL thread counts for a child: each of N processes sharing the cores would otherwise start
    one thread per core and oversubscribe them N times (CPU training runs several times slower)."""
    env = {name: str(threads) for name in THREAD_VARS}
    if not os.environ.get(BLAS_VAR):
        env[BLAS_VAR] = str(threads)
    return env
