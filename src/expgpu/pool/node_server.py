"""One warm process per node of a SLURM allocation, that forks the gpu_pool's jobs there:
`srun --overlap --nodes=1 --nodelist=NODE --gres=gpu:G ... python -m expgpu.pool.node_server`
(expgpu.pool.node_servers starts it, one per node, and talks to it over srun's stdin and stdout).

A job started as an srun step of its own pays a new Python and torch's import (seconds) before its
first line; forked from this process, which imported them once, it starts at once, as the local pool's
jobs do (expgpu.procs.forkserver). Its step holds all the allocation's GPUs and CPUs on the node
(--overlap: it shares them with nothing else of the sweep's, since every job then comes through here),
and each forked job gets only its own: CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS with its GPUs, its
share of the node's CPUs (sched_setaffinity), its thread budget, and the SLURM variables of a step of
its own (its node's rank among the job's nodes), so that expgpu's app in it finds its rank as under srun.

Lines of JSON, one message each:
    launcher -> server  {"warm": modules, "path": sys.path, "context": file}    import, unpickle ahead (the
                                                                                 first message, before "ready")
                        {"start": num, "job_file": f, "console": f, "env": {..}, "cpus": [..]}
                        {"signal": num, "sig": 15}                               to the job's process group
    server -> launcher  {"ready": node, "gpus": [..], "step_gpus": [..], "cpus": [..]}   once, warm
                        {"started": num, "pid": pid}  {"ended": num, "code": exit code as Popen's}
End of input (the launcher closed it, or died): every job's process group is killed, and the server exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

from expgpu import procs
from expgpu.procs.forkserver import ChildWakeups, after_fork


def _say(msg: dict) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())   # unbuffered: srun relays it at once (srun -u)


def _listed(name: str) -> list[str]:
    return [x for x in os.environ.get(name, "").split(",") if x]


def main() -> None:
    from expgpu.pool import job_process

    job_process.warm_up(["cloudpickle", "hydra.core.utils", "expgpu.app", "expgpu.rundir"])
    first = json.loads(sys.stdin.buffer.raw.readline() or b"{}")   # the launcher's import path and modules
    if "warm" in first:   # (torch: most of a job's start-up) before "ready", so the first jobs start warm
        job_process.warm_up(first["warm"], first["path"], first.get("context"))
    from omegaconf import OmegaConf

    OmegaConf.create({"a": 1, "b": "${a}"}).b   # antlr's parser tables, once (job_process.main says why)
    wakeups = ChildWakeups()
    # SLURM signals every process of the step (a preemption, scancel): the jobs save on it, and the server
    # must outlive them (its children die with it), so it only notes it. A job gets the default back.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, lambda *_: None)
    _say({"ready": socket.gethostname(), "gpus": _listed("CUDA_VISIBLE_DEVICES"),
          "step_gpus": _listed("SLURM_STEP_GPUS") or _listed("SLURM_JOB_GPUS"),
          "cpus": sorted(os.sched_getaffinity(0)), "step": os.environ.get("SLURM_STEP_ID")})
    serve(wakeups)


def serve(wakeups: ChildWakeups) -> None:
    from expgpu.pool import job_process

    jobs: dict[int, int] = {}   # pid -> job number
    pending = b""
    while True:
        ready = select.select([0, wakeups.r], [], [])[0]
        if wakeups.r in ready:
            wakeups.drain()
            for pid, code in procs.reaped():
                if pid in jobs:
                    procs.kill_group(pid)   # what it left behind (a loader's workers) goes too
                    _say({"ended": jobs.pop(pid), "code": code})
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 20)
        if not data:   # the launcher is gone: nothing of the sweep's outlives it
            for pid in jobs:
                procs.kill_group(pid)
            os._exit(0)
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in filter(None, lines):
            msg = json.loads(line)
            if "warm" in msg:
                job_process.warm_up(msg["warm"], msg["path"], msg.get("context"))
            elif "start" in msg:
                jobs[_fork(msg, wakeups)] = msg["start"]
            elif "signal" in msg:
                for pid, num in jobs.items():
                    if num == msg["signal"]:
                        procs.kill_group(pid, msg["sig"])


def _fork(msg: dict, wakeups: ChildWakeups) -> int:
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            after_fork(server, wakeups)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)   # not the launcher's messages
            _run(msg)
        finally:
            os._exit(1)
    _say({"started": msg["start"], "pid": pid})
    return pid


def _run(msg: dict) -> None:
    """In the forked child: become the job's process on this node, run it, exit."""
    from expgpu.pool import job_process

    job_process.console(msg["console"])
    os.sched_setaffinity(0, msg["cpus"])
    job_process.take_job({"env": msg["env"], "threads": msg["env"].get("OMP_NUM_THREADS")}, [])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    code = job_process.run_job(Path(msg["job_file"]), send_back=msg["env"].get("SLURM_PROCID", "0") == "0")
    procs.fast_exit(code)


if __name__ == "__main__":
    main()
