"""This node's ranks: starting them, supervising them, and what a rank process runs.

    spawn.py        `launch.nproc_per_node=N`: the supervisor of N worker processes (fail-fast, no orphans)
    run_leases.py   a run started by hand leases its GPUs as a gpu_pool job does, planned around the leased ones
    worker.py       one rank, from "who am I" to result.json (`python -m expgpu.launch.worker RUN_DIR`)
    task_env.py     what a task function finds around it: its prints a whole line at a time, torchrun's variables
    failures.py     a rank's failure record, and whose failure a rank's error echoes (one line, not a traceback)
    warm.py         this launch's ranks forked from one process that imported torch once
    warm_server.py  such a process shared by every launch on the machine (`python -m expgpu.warm_server`)
    warm_client.py  a launch's side of the warm server
    requeue.py      after a stop checkpoint: who requeues the job, and how the process ends
    restarts.py     after a crash or a hang: the world started again, up to launch.max_restarts times (spawn's
                    loop, and `python -m expgpu.launch.restarts` for scripts/expgpu.sbatch's)
    bad_nodes.py    on SLURM, such a restart without the node the failure was on (launch.exclude_bad_nodes): the
                    next srun step's --exclude, or the job requeued with it in its ExcNodeList

Launchers only start processes with the right environment; each rank then walks the same straight
line (docs/architecture.md). Nothing here is imported at `import expgpu`.
"""

__all__ = ["bad_nodes", "failures", "requeue", "restarts", "run_leases", "spawn", "task_env", "warm", "warm_client",
           "warm_server", "worker"]
