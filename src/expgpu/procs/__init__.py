"""Process plumbing every launcher shares, with no torch and no Hydra (launchers import it on every start).

    lifetime.py      a child dies with its launcher, its group goes with it, its exit is seen at once,
                     it exits fast (die_with_parent, kill_group, reaped, exit_fd, fast_exit)
    threads.py       the CPU threads a process may use when several share the cores
    stop_signals.py  the one owner of SIGINT / SIGTERM / SIGUSR2 in a process: a stop request, not a kill
    forkserver.py    a warm process that forks jobs or ranks (gpu_pool's, a launch's, the warm server's)
    handles.py       ProcHandle and RankStarter: what launchers need of a process, however it started
    stacks.py        where a process is: its threads' stacks and the frame that says it (this one's; a
                     script's, read by py-spy)
    hang_rules.py    when a run is hung and how it is said: the limit, the verdict, the culprits, the line
                     (the function tasks' watchdog and the script tasks' watch share them)
    environ.py       this process's environment changed for a while and put back (kept)

The helpers of lifetime.py and threads.py are this package's face: `from expgpu import procs;
procs.kill_group(pid)`.
"""

from expgpu.procs.lifetime import (
                                   ATEXIT_GRACE_S,
                                   ENV_ATEXIT_GRACE,
                                   atexit_grace_s,
                                   die_with_parent,
                                   exit_fd,
                                   fast_exit,
                                   kill_group,
                                   reaped,
)
from expgpu.procs.threads import BLAS_VAR, THREAD_VARS, cores, threads_env, user_threads

__all__ = ["ATEXIT_GRACE_S", "BLAS_VAR", "ENV_ATEXIT_GRACE", "THREAD_VARS", "atexit_grace_s", "cores",
           "die_with_parent", "exit_fd", "fast_exit", "kill_group", "reaped", "threads_env", "user_threads"]
