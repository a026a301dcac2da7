"""The launcher's loop over its jobs' processes, the free GPUs and the signals it receives:
reap finished jobs, lease free GPUs, start what fits (scheduler), keep spares warm, show it."""

from __future__ import annotations

import math
import os
import select
import signal
import time
from pathlib import Path

from expgpu import procs
from expgpu.pool import jobs as jobfiles
from expgpu.pool import requeue, steps
from expgpu.pool.board import Board
from expgpu.pool.jobs import Job, Record
from expgpu.pool.scheduler import Scheduler
from expgpu.pool.settings import Settings
from expgpu.pool.spares import SPARES_LOG, Spare
from expgpu.pool.starts import Starter
from expgpu.pool.steps import StepStarter
from expgpu.results import CUT_SHORT

# A second signal this soon after the first, the same one, is the same request (the batch shell hands on
# what SLURM may have sent this process too), not a second Ctrl-C that kills at once.
SAME_SIGNAL_S = 1.0
POLL_S = 0.02   # how often the launcher looks at its jobs and the free GPUs (at the latest: it
                # wakes at once when a job's process exits)
# pool.json is rewritten whole, every job's row, atomically (fsyncs and a rename): a few ms for a small
# sweep, ~15 ms at 1000 jobs and ~45 ms at 3000 on 2 cores. Written after every start and end, that made
# a large sweep's loop slower as it grew (the writes O(jobs) each, twice per job), and cost an
# optimizing sweeper's loop ~8 ms twice a trial on a busy disk. So while jobs run it is written at most
# this often (its readers, the report and `expgpu status`, are display: a second behind is fine);
# always at the start and the end of a launch.
RECORD_EVERY_S = 1.0


class Pool(StepStarter, Starter):
    def __init__(self, jobs: list[Job], gpus: list, s: Settings, sweep_dir: Path, context: Path,
                 lease_dir: Path | None, desc: str, spares: list[Spare], record: Record,
                 job_env: dict[str, str], threads: int | None, warm: list[str], own_code: bool, server,
                 prime: bool, alloc=None):
        self.jobs, self.gpus, self.s = jobs, gpus, s
        self.alloc = alloc         # the SLURM allocation it runs in (expgpu.pool.allocation): jobs are srun steps
        self.node_servers = None   # or, there, node -> its warm process that forks the jobs (pool.node_servers)
        self._steps_killed = False
        self.sweep_dir, self.context, self.lease_dir = sweep_dir, context, lease_dir
        self.scheduler = Scheduler(patience=max(1, len(gpus)))
        self.board: Board | None = None
        self.desc, self.record = desc, record
        self.job_env, self.threads, self.warm = job_env, threads, warm   # what every job gets
        self.own_code = own_code   # spares may import the task's modules ahead (spares.task_modules)
        self.server = server       # the fork server the spares are forked from
        self.prime = prime         # spares may be primed with their next job (spares.primable)
        self.stop_signal: int | None = None
        self._hard = False
        self._signalled = 0.0
        self._kill_at: float | None = None
        self._waiting_since: float | None = None
        self._busy_elsewhere: tuple = ()
        self.others = None           # expgpu.pool.busy.Others, where GPUs others compute on are waited for
        self._used_by_others: dict = {}   # GPU index -> (the GPU, the processes outside expgpu on it)
        self._said_busy: set[int] = set()  # the GPUs the board said are in use outside expgpu (until they free)
        self.spares = spares   # processes started ahead of their jobs
        self.expected = 0      # jobs a sweeper will add soon (expgpu.pool.session): spares kept for them
        self._old_handlers: dict = {}
        self._dirty = False    # pool.json is behind
        self._recorded_at = 0.0   # when it was last written (time.monotonic())
        self._recorded_note = ""  # the board's waiting line it was written with
        self._spares_broken = False   # a spare died before it got a job: stop starting them ahead
        self.capacity = int(min(len(gpus) + (s.cpu_slots if not gpus or any(j.need == 0 for j in jobs) else 0),
                                s.max_parallel or math.inf))

    def run(self) -> None:
        """Every job to its end (Hydra's blocking launch())."""
        self.begin()
        try:
            while True:
                self.round()
                if not self.busy():
                    return
                self.board.tick()
                self._idle(POLL_S)
        finally:
            self.end()

    def begin(self) -> None:
        """Before the first round: pool.json, the board, the launcher's own Ctrl-C / SIGTERM."""
        self._write_record()
        self.board = Board(self.jobs, self.desc)
        # Inside an allocation SIGUSR2 is SLURM's warning of its end: stop, save, maybe requeue (pool.requeue)
        stops = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGUSR2,) if self.alloc is not None else ())
        try:
            for sig in stops:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: signals stay with whoever handles them
            pass
        from expgpu.procs import stop_signals

        early = stop_signals.current() and stop_signals.current().received
        if early:  # a Ctrl-C while Hydra composed the sweep: the CLI's StopSignals kept it for us
            self.stop_signal = signal.Signals[early]

    def end(self) -> None:
        """After the last round (or an error in one): nothing outlives the launcher."""
        for job in self._running():
            job.sent_kill = True
            self._kill(job)
            job.proc.wait()
        for job in self.jobs:
            job.close_exit_fd()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        self.board.close()
        if self.others is not None:
            self.others.close()
        self._write_record()
        self.record.close(self.jobs)
        if self.alloc is not None:
            requeue.after_stop(self.alloc.job_id, self.stop_signal, self.s.max_requeues, self.sweep_dir, os.environ)

    def round(self) -> list[Job]:
        """One look at the jobs: reap, start what fits, read what the ended ones sent back, keep
        spares warm; the jobs that ended in it (their `ret` set)."""
        ended = self._reap()
        self.board.hold()   # the ended jobs' lines before those of the jobs started in their place
        try:
            if self.s.timeout_min is not None:
                self._time_limits()
            if self.stop_signal is not None:
                self._stopping()
            elif any(j.state == "queued" for j in self.jobs) and self.alloc is not None:
                self._start_steps()
            elif any(j.state == "queued" for j in self.jobs):
                self._start_ready()
                self._check_waiting()
                self._dirty |= self.board.note != self._recorded_note   # why they wait, for expgpu status
            self._settle(ended)
        finally:
            self.board.release()
        if self.server is not None:
            self._keep_spares()
        if self._dirty and time.monotonic() - self._recorded_at >= RECORD_EVERY_S:   # after the starts
            self._write_record()
        return ended

    def _write_record(self) -> None:
        self._dirty = False
        self._recorded_note = self.board.note if self.board is not None else ""
        self.record.write(self.jobs, self.stop_signal, self._recorded_note)
        self._recorded_at = time.monotonic()

    def busy(self) -> bool:
        return any(j.state in ("queued", "running") for j in self.jobs)

    def _running(self) -> list[Job]:
        return [j for j in self.jobs if j.state == "running"]

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self.stop_signal is None:
            self.stop_signal, self._signalled = signum, now
        elif signum == self.stop_signal and now - self._signalled < SAME_SIGNAL_S:
            pass   # the same request twice (the batch shell passed on what SLURM sent this process too)
        elif self.stop_signal == signal.SIGUSR2 and signum == signal.SIGTERM:
            self.stop_signal = signum   # SLURM ends the job after its warning: it decides what comes next
        else:
            self._hard = True   # a second Ctrl-C: kill now

    def _stopping(self) -> None:
        if self._kill_at is None:
            for job in self.jobs:
                if job.state == "queued":
                    job.state = "not_started"
            name = signal.Signals(self.stop_signal).name
            # SIGUSR2 (an allocation's warning) goes on as SIGTERM: a job's rank 0 would take it for its own
            # requeue and requeue the whole allocation
            self._signal(self._running(), signal.SIGTERM if self.stop_signal == signal.SIGUSR2 else
                         signal.Signals(self.stop_signal))
            self._kill_at = time.monotonic() + self.s.grace_s
            self.board.event(f"{name}: stopping {len(self._running())} running job(s) "
                             f"(SIGKILL in {self.s.grace_s:.0f}s, again to kill now)")
            self._dirty = True
        if self._hard or time.monotonic() > self._kill_at:
            if self.alloc is not None and self._running() and not self._steps_killed:   # their tasks too, everywhere
                self._steps_killed = True
                self._signal(self._running(), signal.SIGKILL)
            for job in self._running():
                job.sent_kill = True
                self._kill(job)

    def _time_limits(self) -> None:
        """A job past hydra.launcher.timeout_min: SIGTERM (an expgpu job saves and ends), SIGKILL grace_s later."""
        now, limit_s = time.time(), 60 * self.s.timeout_min
        for job in self._running():
            if job.timed_out is None and now - job.started > limit_s:
                job.timed_out = f"ran past hydra.launcher.timeout_min={self.s.timeout_min:g} ({limit_s:.0f} s)"
                job.kill_at = time.monotonic() + self.s.grace_s
                self._signal([job], signal.SIGTERM)
                self.board.event(f"#{job.num} {job.timed_out} on {job.where}: SIGTERM, SIGKILL in "
                                 f"{self.s.grace_s:.0f}s")
            elif job.timed_out is not None and time.monotonic() > job.kill_at:
                job.kill_at = math.inf   # once (through SLURM, a call per step): it is reaped when it is gone
                self._signal([job], signal.SIGKILL)

    def _signal(self, jobs: list[Job], sig: signal.Signals) -> None:
        """`sig` to the jobs' processes: each one's process group, or inside an allocation, for a job forked by a
        node's warm process, through that process; for an srun step, to its tasks on every node through SLURM
        (their ranks save and end; srun itself would end its step on SIGTERM). A step not started yet has
        nothing to save: its srun ends it."""
        steps_of = [j for j in jobs if self.alloc is not None and not hasattr(j.proc, "signal_group")]
        for job in jobs:
            job.sent_kill = job.sent_kill or sig == signal.SIGKILL
            if job not in steps_of:
                self._kill(job, sig)
        if steps_of:
            told = steps.signal_steps(self.alloc.job_id, {steps.step_name(j.num): j.num for j in steps_of}, sig)
            for job in steps_of:
                if job.num not in told:
                    procs.kill_group(job.proc.pid, signal.SIGKILL if sig == signal.SIGKILL else signal.SIGTERM)

    @staticmethod
    def _kill(job: Job, sig: int = signal.SIGKILL) -> None:
        """`sig` to the job's process group (on each of its nodes, for a job forked by warm node processes)."""
        if hasattr(job.proc, "signal_group"):
            job.proc.signal_group(sig)
        else:
            procs.kill_group(job.proc.pid, sig)

    def _reap(self) -> list[Job]:
        """Jobs whose process has just exited: their GPUs and slots are free from now on."""
        ended = []
        for job in self._running():
            code = job.proc.poll()
            if code is None:
                continue
            # The job is over: whatever it left running in its group (a forked loader worker
            # holding the lease descriptor) goes too, so its GPUs free up now.
            self._kill(job)
            job.close_exit_fd()
            job.ended, job.returncode, job.state = time.time(), code, "ending"
            ended.append(job)
        return ended

    def _settle(self, ended: list[Job]) -> None:
        """Read what the ended jobs sent back (after the next jobs have started: not on their path)."""
        for job in ended:
            job.ret = self._job_return(job, job.returncode)
            took = job.ended - job.started
            if job.state == "finished":
                self.board.event(f"#{job.num} {_cut_short(job.ret) or 'finished'} in {took:.1f}s on {job.where}",
                                 first=True)
            else:
                self.board.event(f"#{job.num} {job.state} after {took:.1f}s on {job.where}: {job.error}", first=True)
            self._dirty = True

    def _job_return(self, job: Job, code: int | None):
        spares_log = self.sweep_dir / jobfiles.STATE / SPARES_LOG
        return jobfiles.job_return(job, code, self.stop_signal, spares_log)

    def _idle(self, timeout: float) -> None:
        """Wait until a running job's process exits or `timeout` passes: a slot is refilled the
        moment its job ends, not up to a poll interval later (a wave of 1-s jobs loses ~1%)."""
        fds = [j.exit_fd for j in self._running() if j.exit_fd is not None]
        fds += [server.fd for server in (self.node_servers or {}).values() if not server.gone]
        # the fork server reports a fork's exit code a moment after the exit
        if fds and self.server is not None and self.server.sock is not None:
            fds.append(self.server.sock)
        if fds:
            select.select(fds, [], [], timeout)
        else:
            time.sleep(timeout)

    def summary(self, log) -> None:
        bad = [j for j in self.jobs if j.state in ("failed", "stopped")]
        if self.board is not None and not self.board.was_live:   # else the table says it already
            log.info("gpu_pool: %s", self.board.counts())
        for j in bad:
            log.error("%s", j.failure())
            if isinstance(getattr(j.ret, "_return_value", None), jobfiles.JobFailed):
                j.ret._return_value.reported = True


def _cut_short(ret) -> str:
    """`pruned at step 120`, `diverged at step 10`: an expgpu job that ended for good before its end (its result.json,
    returned: an objective's value is returned only for a finished run); "" for any other job."""
    value = getattr(ret, "_return_value", None)
    if isinstance(value, dict) and value.get("status") in CUT_SHORT:
        return f"{value['status']} at step {value.get('steps')}"
    return ""
