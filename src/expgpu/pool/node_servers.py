"""Warm starts inside a SLURM allocation: the launcher's side of expgpu.pool.node_server, one per node.

Each server is an srun step with --overlap on its node, holding the allocation's GPUs and CPUs there; the
pool forks every job from them (a job on k nodes: one process on each of its nodes' servers) instead of
starting an srun step per job, and so a job starts in a process that has torch imported already. What
SLURM's step would have confined (the job's GPUs, its CPUs) the fork is given instead: the GPUs the pool
leased it as CUDA_VISIBLE_DEVICES (the server's own entries for them, as SLURM set them for its step) and
SLURM_STEP_GPUS, and the CPUs that go with them (the node's CPUs in equal shares per GPU) as its affinity
and thread budget. Memory is not confined per job.

The pool waits for every server to say "ready" before it starts a job (a job started as a step beside
them could get GPUs a fork uses: SLURM counts the servers' GPUs as free, --overlap). A server that does
not come up (SLURM refuses --overlap, it dies, READY_TIMEOUT_S passes) turns warm starts off for the sweep:
its jobs are srun steps, with one line saying why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import hostlist

from expgpu import procs
from expgpu.pool.allocation import Allocation, Slot

READY_TIMEOUT_S = 180.0   # a server's srun step and torch's import, on busy nodes


class NodeServer:
    """One node's server: its srun step's process here, what it said, and how to talk to it."""

    def __init__(self, node: str, alloc: Allocation, warm: Sequence[str], log: Path, name: str, env: dict):
        gres = [] if alloc.cpu else [f"--gres=gpu:{len(alloc.gpus[node])}"]
        cmd = ["srun", "--overlap", "--unbuffered", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks=1",
               f"--nodelist={node}", *gres, f"--cpus-per-task={alloc.cpus[node]}", f"--job-name={name}"]
        if alloc.mem_mb is not None:
            cmd.append(f"--mem={alloc.mem_mb}M")
        self.node, self.started = node, time.monotonic()
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([*cmd, sys.executable, "-m", "expgpu.pool.node_server"], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                         start_new_session=True)
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.info: dict | None = None            # its "ready" message: GPUs, CPUs
        self.pids: dict[int, int] = {}           # job number -> its process there
        self.codes: dict[int, int] = {}          # job number -> its exit code
        self.gone = False
        self._buf = b""
        self.send({"warm": list(warm), "path": list(sys.path), "context": None})

    def send(self, msg: dict) -> None:
        if self.gone:
            return
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.gone = True

    def pump(self) -> None:
        """Read what the server said, without waiting."""
        while not self.gone:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:   # its step ended: its jobs died with it
                self.gone = True
                return
            *lines, self._buf = (self._buf + data).split(b"\n")
            for line in filter(None, lines):
                self._heard(json.loads(line))

    def _heard(self, msg: dict) -> None:
        if "ready" in msg:
            self.info = msg
        elif "started" in msg:
            self.pids[msg["started"]] = msg["pid"]
        elif "ended" in msg:
            self.codes[msg["ended"]] = msg["code"]

    def code(self, num: int) -> int | None:
        """Job `num`'s exit code here; None while it runs (SIGKILL's if the server is gone)."""
        if num in self.codes:
            return self.codes[num]
        return -signal.SIGKILL if self.gone else None

    def gpus_and_cpus(self, slots: Sequence[Slot], alloc: Allocation) -> tuple[str, str, list[int]]:
        """(CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS, CPUs) of a job given these of the node's GPUs (or shares of
        them: expgpu.pool.sharing); of its CPU slots in an allocation without GPUs: no GPU, and the slots'
        share of the CPUs."""
        return share([s.index for s in slots], list(alloc.gpus[self.node]), self.info, alloc.cpu,
                     [getattr(s, "share", 0) for s in slots], getattr(slots[0], "of", 1))

    def close(self) -> None:
        """End of its input: it kills what runs and exits; its step ends with it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            procs.kill_group(self.proc.pid)
            self.proc.wait()


def share(indices: Sequence[int], node_gpus: list[int], info: dict, cpu: bool = False,
          shares: Sequence[int] = (), of: int = 1) -> tuple[str, str, list[int]]:
    """(CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS, CPUs) of a job given `indices` of the node's GPUs (SLURM's IDX),
    from what the node's server said of its step: its GPUs as SLURM showed them to it (`gpus`, `step_gpus`)
    and its CPUs, shared out equally per GPU (all of them to every job where there are fewer CPUs than GPUs).
    `shares`, `of`: which of `of` shares of each GPU the job has (hydra.launcher.jobs_per_gpu): that part of
    the GPU's CPUs (all of the GPU's, where it has fewer than `of`).
    `cpu`: the indices are CPU slots (an allocation without GPUs): no GPU, and the slots' share of the CPUs."""
    step = [] if cpu else info.get("step_gpus") or [str(i) for i in node_gpus]
    seen = info.get("gpus") or step
    at = [step.index(str(i)) if str(i) in step else node_gpus.index(i) for i in indices]
    cpus, per = info["cpus"], len(info["cpus"]) // max(1, len(node_gpus))
    part = per // of   # a share's CPUs of its GPU's; 0: fewer than `of` there, all of them to each share
    mine = []
    for p, k in zip(at, shares or [0] * len(at)):
        low = p * per + (k * part if part else 0)
        mine += cpus[low:low + (part or per)]
    mine = mine or list(cpus)
    if cpu:
        return "", "", mine
    return ",".join(seen[p] for p in at), ",".join(step[p] for p in at), mine


def rank_env(rank: int, nodes: Sequence[str], step: str | None) -> dict[str, str]:
    """The SLURM variables of one task per node of a step on `nodes`: this fork is task `rank`; `step`, the
    step id the job's processes share (its first node's server's: each node's server is a step of its own)."""
    n = str(len(nodes))
    per_node = "1" if len(nodes) == 1 else f"1(x{n})"
    ids = {"SLURM_STEP_ID": step, "SLURM_STEPID": step} if step else {}
    return {**ids, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank), "SLURM_LOCALID": "0", "SLURM_GTIDS": str(rank),
            "SLURM_STEP_NUM_TASKS": n, "SLURM_STEP_NUM_NODES": n, "SLURM_STEP_TASKS_PER_NODE": per_node,
            "SLURM_STEP_NODELIST": hostlist.collect_hostlist(list(nodes)), "SLURM_NTASKS": n, "SLURM_NPROCS": n,
            "SLURM_NNODES": n, "SLURM_TASKS_PER_NODE": per_node}


class RemoteJob:
    """A job's processes on its nodes' servers, as much of subprocess.Popen as the pool uses; like
    `srun --kill-on-bad-exit`, the first to fail ends the others."""

    def __init__(self, num: int, servers: list[NodeServer]):
        self.num, self.servers = num, servers
        self._killed = False

    @property
    def pid(self) -> int | None:   # rank 0's, on its node (pool.json)
        return self.servers[0].pids.get(self.num)

    def poll(self) -> int | None:
        for server in self.servers:
            server.pump()
        codes = [s.code(self.num) for s in self.servers]
        bad = [c for c in codes if c not in (None, 0)]
        if bad and None in codes and not self._killed:
            self._killed = True
            self.signal_group(signal.SIGKILL)
        return None if None in codes else (bad[0] if bad else 0)

    def wait(self, timeout: float = 30.0) -> int | None:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return code

    def signal_group(self, sig: int) -> None:
        for server in self.servers:
            if self.num not in server.codes:
                server.send({"signal": self.num, "sig": int(sig)})


def start_all(alloc: Allocation, warm: Sequence[str], log: Path, name: str, env: dict) -> dict[str, NodeServer]:
    return {node: NodeServer(node, alloc, warm, log, f"{name}-{i}", env) for i, node in enumerate(alloc.nodes)}


def waiting(servers: dict[str, NodeServer]) -> str | None:
    """None once every server is ready; "" while some are still coming up; else why warm starts are off."""
    for server in servers.values():
        server.pump()
    for server in servers.values():
        if server.info is None and (server.gone or server.proc.poll() is not None):
            return f"the warm process on {server.node} ended before it was ready (srun --overlap refused?)"
        if server.info is None and time.monotonic() - server.started > READY_TIMEOUT_S:
            return f"the warm process on {server.node} was not ready within {READY_TIMEOUT_S:.0f} s"
    return "" if any(s.info is None for s in servers.values()) else None


def job_slots(slots: Sequence[Slot]) -> dict[str, list[Slot]]:
    """The job's GPUs by node, in SLURM's node order as given."""
    out: dict[str, list[Slot]] = {}
    for s in slots:
        out.setdefault(s.node, []).append(s)
    return out
