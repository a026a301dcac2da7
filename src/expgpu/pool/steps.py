"""Inside a SLURM allocation, each gpu_pool job is an srun step on the node(s) whose GPUs it was given:
the command, its environment, its CPUs and memory, and the start. The half of expgpu.pool.loop.Pool that
starts steps (mixed in, as expgpu.pool.starts for local jobs); the loop reaps them like local jobs.

    srun --exact --kill-on-bad-exit=1 --nodes=K --nodelist=NODES --ntasks=K --ntasks-per-node=1
         --gres=gpu:G --cpus-per-task=C [--mem=M] python -m expgpu.pool.step_process JOB_FILE

(no --gres in an allocation without GPUs, whose jobs take CPU slots: expgpu.pool.allocation.on_cpu_slots).

One task per node, as hydra/launcher=slurm asks for an expgpu job (expgpu.slurm.resources): its
ranks come from SLURM's variables, and launch.nproc_per_node=N starts N ranks on each node. --exact:
the step gets only what it asks for, so steps run side by side; SLURM picks which of a node's GPUs
(CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS). Its output goes to the job dir's console.log; its exit code
(srun's: the worst task's) and the JobReturn its first task sent back are the job's outcome.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

from expgpu import envvars, procs
from expgpu.errors import one_line
from expgpu.pool import jobs as jobfiles
from expgpu.pool import node_servers, sharing
from expgpu.pool.allocation import Allocation, Slot
from expgpu.pool.allocation import fit as fit_on_nodes
from expgpu.pool.jobs import Job

log = logging.getLogger("expgpu.pool")

# What srun reads from its environment as if given on its command line (srun(1), INPUT ENVIRONMENT
# VARIABLES), set by the allocation's salloc/sbatch: a step would inherit the allocation's shape
# (--ntasks-per-node=4, all its memory, its GPUs per task) over the one the pool gives it.
SRUN_INPUTS = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NNODES",
               "SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK", "SLURM_CPUS_PER_GPU", "SLURM_GPUS", "SLURM_GPUS_PER_NODE",
               "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET", "SLURM_TRES_PER_TASK", "SLURM_MEM_PER_NODE",
               "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU", "SLURM_EXCLUSIVE", "SLURM_OVERLAP", "SLURM_DISTRIBUTION",
               "SLURM_NTASKS_PER_GPU", "SLURM_NTASKS_PER_SOCKET", "SLURM_NTASKS_PER_CORE")
# MASTER_PORT of a job's step: steps of one allocation running at once need ports of their own (the
# ranks' default, 15000 + the job id, would be the same for all). Below Linux's ephemeral range.
PORT_BASE, PORT_SPAN = 15000, 32768 - 15000


def master_port(job_id: str, num: int) -> int:
    """Distinct for the jobs of one sweep, and apart from a neighbouring allocation's (job ids differ by 1)."""
    return PORT_BASE + (int(job_id) * 1009 + num) % PORT_SPAN


def step_cpus(alloc: Allocation, slots: Sequence[Slot]) -> int:
    """CPUs of each of the step's tasks: the node's CPUs in proportion to the GPUs (CPU slots) it takes
    there (the least of its nodes), at least 1."""
    share = []
    for node in {s.node for s in slots}:
        took = sum(s.node == node for s in slots)
        share.append(alloc.cpus[node] * took // max(1, len(alloc.gpus[node])))
    return max(1, min(share))


def step_mem_mb(alloc: Allocation, slots: Sequence[Slot]) -> int | None:
    """--mem of the step: the node's memory in proportion to its GPUs there; None when the allocation
    asked for none (a step would otherwise ask for all of it, and steps could not run side by side)."""
    if alloc.mem_mb is None:
        return None
    node = slots[0].node
    took = sum(s.node == node for s in slots)
    return max(1, alloc.mem_mb * took // max(1, len(alloc.gpus[node])))


def step_name(num: int) -> str:
    """A job's step name, this launcher's own (another sweep may share the allocation): how a stop finds it."""
    return f"expgpu-pool-{os.getpid()}-{num}"


def srun_command(slots: Sequence[Slot], cpus: int, mem_mb: int | None, job_file: str, name: str = "") -> list[str]:
    nodes = list(dict.fromkeys(s.node for s in slots))
    per_node = len(slots) // len(nodes)
    gres = [] if slots[0].cpu else [f"--gres=gpu:{per_node}"]
    cmd = ["srun", "--exact", "--kill-on-bad-exit=1", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
           f"--ntasks={len(nodes)}", "--ntasks-per-node=1", *gres, f"--cpus-per-task={cpus}"]
    if name:
        cmd.append(f"--job-name={name}")
    if mem_mb is not None:
        cmd.append(f"--mem={mem_mb}M")
    return cmd + [sys.executable, "-m", "expgpu.pool.step_process", job_file]


# How long squeue and scancel may take to answer a stop (the controller may be busy)
SLURM_CALL_S = 15.0


def signal_steps(job_id: str, names: Mapping[str, int], sig: signal.Signals) -> set[int]:
    """Send `sig` to the tasks of the running steps named in `names` (step name -> job number), on every
    node, through SLURM: `scancel --signal` signals a step's tasks and leaves the step running, so its ranks
    save and end on their own (srun itself would end its step on SIGTERM, and answer SIGINT with a status
    line). The job numbers whose step was signalled; a step not started yet is not among them."""
    try:
        listed = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True,
                                text=True, timeout=SLURM_CALL_S).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("gpu_pool: could not list the allocation's steps to stop them (%s)", one_line(e))
        return set()
    steps = {name: step for step, name in (ln.split(None, 1) for ln in listed.splitlines() if " " in ln)
             if name in names}
    done = set()
    for name, step in steps.items():
        try:
            subprocess.run(["scancel", f"--signal={sig.name.removeprefix('SIG')}", step], capture_output=True,
                           text=True, timeout=SLURM_CALL_S, check=True)
            done.add(names[name])
        except subprocess.CalledProcessError as e:
            # SLURM 22.05 with a step on some of the allocation's nodes: its tasks get the signal, then scancel
            # exits 225, "Kill job error on job step id N: Invalid job id specified" (the nodes without the
            # step). Taken as sent: falling back to SIGTERM on srun would cancel the step, killing ranks that
            # are saving. If it did not land, the caller's SIGKILL after grace_s still ends the step.
            if "Invalid job id specified" in (e.stderr or ""):
                done.add(names[name])
            else:
                log.warning("gpu_pool: could not signal step %s (%s)", step, one_line(e.stderr or e))
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("gpu_pool: could not signal step %s (%s)", step, one_line(e))
    return done


def step_env(env: Mapping[str, str], job_env: Mapping[str, str]) -> dict[str, str]:
    out = {k: v for k, v in env.items() if k not in SRUN_INPUTS and not k.startswith(envvars.POOL_PREFIX)}
    out.update(job_env)
    return out


class StepStarter:
    """Mixed into Pool, whose attributes (jobs, alloc, s, scheduler, board, ...) it uses."""

    def _start_steps(self) -> None:
        if self.node_servers is not None and not self._servers_ready():
            return
        running = self._running()
        room = (self.s.max_parallel or float("inf")) - len(running)
        if room <= 0:
            return
        ours = {g for j in running for g in j.gpus}
        free = [g for g in self.gpus if g not in ours]
        waiting = [(j.num, j.need) for j in self.jobs if j.state == "queued"]
        nodes = {j.num: j.nodes for j in self.jobs}
        by_num = {j.num: j for j in self.jobs}

        def fit(gpus, num, need):   # need/nodes GPUs on each of the job's nodes
            return fit_on_nodes(gpus, need, nodes[num])

        start = self._start_step if self.node_servers is None else self._start_warm
        for num, slots, _ in self.scheduler.pick(waiting, free, [], room, fit):
            start(by_num[num], list(slots))

    def _servers_ready(self) -> bool:
        """Whether jobs may start: every node's warm process is ready (or warm starts have been turned off)."""
        why = node_servers.waiting(self.node_servers)
        if why == "":
            self.board.waiting(f"waiting for the warm processes on {len(self.node_servers)} node(s)")
            return False
        self.board.waiting("")
        if why is not None:
            shared = self.s.jobs_per_gpu > 1   # and an srun step of its own never shares its GPUs
            log.warning("gpu_pool: warm starts off: %s; each job is an srun step of its own%s", why,
                        f", one on each GPU (hydra.launcher.jobs_per_gpu={self.s.jobs_per_gpu} off)" if shared else "")
            if shared:   # nothing started yet: the pool is the GPUs themselves from now on
                self.gpus = [sharing.card(g) for g in self.gpus if g.share == 0]
            for server in self.node_servers.values():
                server.close()
            self.node_servers = None
        return True

    def _start_warm(self, job: Job, slots: list[Slot]) -> None:
        """The job forked on its nodes' warm processes (expgpu.pool.node_servers), one process per node."""
        job_file = jobfiles.write_job_file(job, self.context)
        by_node = node_servers.job_slots(slots)
        nodes = list(by_node)
        servers = [self.node_servers[n] for n in nodes]
        for rank, (node, server) in enumerate(zip(nodes, servers)):
            visible, step_gpus, cpus = server.gpus_and_cpus(by_node[node], self.alloc)
            env = {**self._step_job_env(job, len(cpus)), **node_servers.rank_env(rank, nodes, servers[0].info["step"]),
                   envvars.LAUNCH_ID: f"slurm-{self.alloc.job_id}.{step_name(job.num)}",
                   "CUDA_VISIBLE_DEVICES": visible, "SLURM_STEP_GPUS": step_gpus, "SLURM_CPUS_PER_TASK": str(len(cpus))}
            server.send({"start": job.num, "job_file": str(job_file), "console": str(job.dir / jobfiles.CONSOLE),
                         "env": env, "cpus": cpus})
        job.proc = node_servers.RemoteJob(job.num, servers)
        job.state, job.gpus, job.started = "running", slots, time.time()
        self.board.event(f"#{job.num} started on {job.where}: {job.label}")
        self._dirty = True

    def _step_job_env(self, job: Job, cpus: int) -> dict[str, str]:
        env = {envvars.POOL_JOB: str(job.num), envvars.START_TIME: str(time.time()),
               "MASTER_PORT": str(master_port(self.alloc.job_id, job.num))}
        if self.alloc.cpu:   # given no GPU: none of the node's, where SLURM does not hide them (no device cgroup)
            env["CUDA_VISIBLE_DEVICES"] = ""
        if self.s.threads_per_job is not None:
            env.update(procs.threads_env(self.s.threads_per_job))
        elif not procs.user_threads():   # a step's ranks share its CPUs, not the node's cores
            env.update(procs.threads_env(cpus))
        return env

    def _start_step(self, job: Job, slots: list[Slot]) -> None:
        cpus = step_cpus(self.alloc, slots)
        console = job.dir / jobfiles.CONSOLE
        try:
            job_file = jobfiles.write_job_file(job, self.context)
            cmd = srun_command(slots, cpus, step_mem_mb(self.alloc, slots), str(job_file), step_name(job.num))
            with open(console, "ab") as out:
                # its own session: a Ctrl-C at the terminal reaches the launcher only, which passes it on
                job.proc = subprocess.Popen(cmd, env=step_env(os.environ, self._step_job_env(job, cpus)),
                                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        except OSError as e:
            job.state, job.error = "failed", f"could not start its srun step: {one_line(e)}"
            job.ret = self._job_return(job, None)
            self.board.event(f"#{job.num} failed to start: {job.error}")
            self._dirty = True
            return
        job.exit_fd = procs.exit_fd(job.proc.pid)
        job.state, job.gpus, job.started = "running", slots, time.time()
        self.board.event(f"#{job.num} started on {job.where}: {job.label}")
        self._dirty = True
