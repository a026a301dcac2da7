"""launch() of expgpu's submitit launchers: check everything, then submit every job or none, then wait.

hydra-submitit-launcher's own launch() submits first and asks questions later: a bad tasks_per_node
fails in every rank after the job waited in the queue, an unknown partition fails with sbatch's
multi-line error, and without accounting (sacct) a cancelled job is waited for forever. Here:
1. every job's config is composed; an expgpu config is checked (its task's parameters too,
   expgpu.task.precheck) and its tasks/GPUs per node derived from its gpu_map, another Hydra app's job
   asks for what hydra.launcher says (resources.py);
2. the cluster is asked (cluster.py): tools on PATH, controller answering, partition known;
3. dry_run=true prints the sbatch script and the plans (preview.py) and submits nothing;
4. jobs are submitted as one array per distinct resource shape (usually one); if a later sbatch
   fails, the arrays already submitted are cancelled;
5. results are awaited; a job that left the queue without a result fails the sweep after lost_after_s.
What runs inside a job is hydra-submitit-launcher's unchanged __call__ (run_job on every srun task).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from expgpu.errors import UserError, WorkerFailed
from expgpu.slurm import cluster, preview, resources

log = logging.getLogger("expgpu")

OWN_KEYS = ("ping_timeout_s", "lost_after_s")   # expgpu's, not submitit's parameters
INIT_KEYS = ("submitit_folder", "max_num_timeout")


class JobLost(WorkerFailed):
    """A submitted job ended without a result (scancel, node failure, SIGKILL, time limit): its ranks
    are gone like failed workers, and the CLI reports it the same way (one line, exit code 1)."""

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.failure = None


@dataclass
class Job:
    num: int                 # hydra.job.num
    overrides: list[str]
    cfg: Any                 # the composed sweep config
    parts: dict | None       # resolved gpu_map / launch / inventory sections; None: another Hydra app's job
    res: resources.Resources
    visible: tuple[int, ...] = ()   # local launcher: the GPUs (NVML indices) the job may see
    script: dict | None = None      # a script task's ScriptSpec (as a dict): the dry run shows its commands
    dry_run: bool = False           # expgpu's dry_run=true: print what would be submitted
    handle: Any = None

    @property
    def label(self) -> str:
        # the user's overrides: not Hydra's own, nor those the sweeper adds (++hydra.job.env_set...)
        own = [o for o in self.overrides if not o.lstrip("+~").startswith("hydra.")]
        return f"#{self.num} ({' '.join(own) or 'no overrides'})"


@dataclass
class Plan:
    """What launch() knows before any job: the executor's kind, its parameters, expgpu's own keys."""
    kind: str          # "slurm" or "local"
    name: str          # the launcher's name in messages: slurm or submitit_local
    params: dict       # submitit's parameters
    own: dict          # OWN_KEYS
    init: dict         # INIT_KEYS
    partition: Any = None

    @property
    def lost_after_s(self) -> float:
        return float(self.own.get("lost_after_s", 60.0))


def plan(launcher) -> Plan:
    kind = launcher._EXECUTOR   # "slurm" or "local"
    params = dict(launcher.params)
    own = {k: params.pop(k) for k in OWN_KEYS if k in params}
    init = {k: params.pop(k) for k in INIT_KEYS if k in params}
    name = "slurm" if kind == "slurm" else "submitit_local"
    resources.check_counts({**params, **init}, name)
    return Plan(kind, name, params, own, init, params.get("partition"))


def compose(launcher, p: Plan, overrides: Sequence[str], num: int) -> Job:
    """Job number `num`, composed. An expgpu config is checked, and its tasks and GPUs per node derived
    from its gpu_map; another Hydra app's job gets what hydra.launcher asks for (resources.requested)."""
    from omegaconf import open_dict

    from expgpu import config
    from expgpu.pool.compose import sweep_config
    from expgpu.pool.job_config import in_job, resolved

    cfg = sweep_config(launcher.hydra_context.config_loader, launcher.config, overrides)
    with open_dict(cfg):
        cfg.hydra.job.num = num   # as the job will have it (its ${hydra:job.num}); the job composes its own
    if not config.is_expgpu(cfg):
        visible = _visible(p, None)
        res = resources.requested(p.params, p.name, len(visible) if p.kind == "local" else None)
        return Job(num, list(overrides), cfg, None, res, visible)
    in_job(cfg, config.check)
    parts = {k: resolved(cfg, k) for k in ("gpu_map", "launch", "inventory")}
    visible = _visible(p, parts["inventory"]["simulate"])
    res = resources.derive(p.params, parts, p.name, visible_gpus=len(visible) if p.kind == "local" else None)
    return Job(num, list(overrides), cfg, parts, res, visible, _script(cfg), bool(cfg.dry_run))


def _visible(p: Plan, simulate) -> tuple[int, ...]:
    """The local launcher's jobs may see the GPUs this process sees (NVML indices; `simulate`: expgpu's
    inventory.simulate); a SLURM job gets its GPUs from SLURM."""
    if p.kind != "local":
        return ()
    from expgpu.gpus import inventory

    return tuple(g.index for g in inventory(simulate))


def _script(cfg) -> dict | None:
    """A script task checked here, before anything is submitted (a missing script is one line now, not a
    failed job after the queue); its command made from this launch dir, as the job will make it."""
    from expgpu.pool.job_config import in_job
    from expgpu.script import spec

    return in_job(cfg, lambda c: spec.checked(c, os.getcwd()))


def check_tasks(jobs: list[Job], label: str | None = None) -> None:
    """Each job's task (its function's parameters, its `_target_` entries' keys), as the job will check it at
    its start: a misspelt key is one line now, not every job failing after its wait in the queue. `label`: what
    the line calls the job (else `job #N (its overrides)`)."""
    from expgpu.pool.job_config import resolved
    from expgpu.task import precheck

    precheck.check([(label or f"job {j.label}", resolved(j.cfg, "task")) for j in jobs if j.parts is not None
                    and j.script is None], then="nothing was submitted")


def check_cluster(p: Plan, dry: bool = False) -> None:
    """sbatch on PATH, the controller answering, the partition known (SLURM only)."""
    if p.kind != "slurm":
        return
    if dry and any(shutil.which(t) is None for t in cluster.TOOLS):
        log.warning("dry run: SLURM is not installed here, so the cluster was not asked (partition, controller)")
    else:
        p.partition = cluster.check(p.partition, float(p.own.get("ping_timeout_s", 15.0)))


def submit(launcher, p: Plan, jobs: list[Job]) -> None:
    """Every job or none (one array per resource shape); each job's handle set."""
    _submit(launcher, _groups(jobs), p.params, p.init, p.kind)


def _groups(jobs: list[Job]) -> dict[tuple, list[Job]]:
    groups: dict[tuple, list[Job]] = defaultdict(list)
    for job in jobs:
        groups[(job.res, job.visible[:job.res.gpus_per_node or 0])].append(job)
    return groups


def launch(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    p = plan(launcher)
    jobs = [compose(launcher, p, overrides, initial_job_idx + i) for i, overrides in enumerate(job_overrides)]
    check_tasks(jobs)
    dry = any(j.dry_run for j in jobs)
    check_cluster(p, dry)
    if dry:
        return _dry_run(_groups(jobs), p.params, p.init, p.kind, p.partition)
    submit(launcher, p, jobs)
    return _results(jobs, p.kind, p.lost_after_s)


def _executor_params(params: dict, job: Job, kind: str) -> dict:
    p = dict(params, nodes=job.res.nodes, tasks_per_node=job.res.tasks_per_node, gpus_per_node=job.res.gpus_per_node)
    if kind == "local":
        # submitit's local executor sets CUDA_VISIBLE_DEVICES to its first gpus_per_node of visible_gpus
        # (0..n-1 when unset): name the GPUs this process sees, so a parent's mask is kept.
        p["visible_gpus"] = list(job.visible)
    return p


def _dry_run(groups, params, init, kind, partition) -> list:
    from hydra.core.utils import JobReturn, JobStatus

    out = []
    returns = {}
    memory = preview.memory_lines([job for group in groups.values() for job in group])
    for (res, _), group in groups.items():
        for job in group:
            out.append(f"job {job.label}: {res}" + (f", partition {partition}" if partition else ""))
            out.append(preview.plan_table(job.parts, res, job.script))
            out.append(memory[job.num])
            returns[job.num] = JobReturn(overrides=job.overrides, status=JobStatus.COMPLETED,
                                         task_name=str(job.cfg.hydra.job.name),
                                         _return_value={"status": "dry_run", "resources": res.__dict__})
        if kind == "slurm":
            folder = str(init.get("submitit_folder", ".submitit/%j"))
            script = preview.sbatch_script(_executor_params(params, group[0], kind), folder, len(group))
            jobs_text = "job " + group[0].label if len(group) == 1 else f"an array of {len(group)} jobs"
            out.append(f"--- sbatch script for {jobs_text} ---\n{script.rstrip()}\n---")
    out.append("dry run: nothing submitted")
    print("\n".join(out), flush=True)
    return [returns[num] for num in sorted(returns)]


def _submit(launcher, groups, params, init, kind) -> None:
    import submitit
    from hydra.core.singleton import Singleton
    from omegaconf import OmegaConf

    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in launcher.config.hydra.sweep:
        os.chmod(sweep_dir, mode=int(str(launcher.config.hydra.sweep.mode), 8))
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    submitted = []
    try:
        for _, group in groups.items():
            if kind == "local":
                # AutoExecutor refuses local_visible_gpus (submitit 1.5 lists only `setup` as valid),
                # which LocalExecutor itself takes.
                executor = submitit.LocalExecutor(folder=init["submitit_folder"])
                executor.update_parameters(**{k: v for k, v in _executor_params(params, group[0], kind).items()
                                              if v is not None})
            else:
                extra = {"slurm_max_num_timeout": init["max_num_timeout"]} if "max_num_timeout" in init else {}
                executor = submitit.AutoExecutor(folder=init["submitit_folder"], cluster=kind, **extra)
                executor.update_parameters(**{k if k in generic else f"{kind}_{k}": v
                                              for k, v in _executor_params(params, group[0], kind).items()})
            args = [(job.overrides, "hydra.sweep.dir", job.num, f"job_id_for_{job.num}", Singleton.get_state())
                    for job in group]
            handles = executor.map_array(launcher, *zip(*args))
            for job, handle in zip(group, handles):
                job.handle = handle
                submitted.append(job)
                log.info("%s -> %s job %s: %s; log %s", job.label, kind, handle.job_id, job.res, handle.paths.stdout)
    except submitit.core.utils.FailedJobError as e:
        _cancel([j.handle for j in submitted], kind)
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no message")
        undone = f"; cancelled the {len(submitted)} job(s) already submitted" if submitted else ""
        raise UserError(f"sbatch refused the job: {reason.strip()}{undone}") from None
    log.info("submitit '%s' sweep output dir: %s", kind, sweep_dir)


def _cancel(handles, kind: str) -> None:
    for handle in handles:
        try:
            handle.cancel(check=False)
        except Exception as e:   # best effort: we are already failing
            log.warning("could not cancel job %s: %s", handle.job_id, e)


def _in_queue(job_ids: list[str]) -> set[str] | None:
    """The ids (array elements as 12_3) squeue still lists; None when squeue could not say."""
    bases = sorted({j.split("_")[0] for j in job_ids})
    try:
        proc = subprocess.run(["squeue", "-h", "-r", "-o", "%i", "-j", ",".join(bases)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return set() if "Invalid job id" in proc.stderr else None
    return set(proc.stdout.split())


def check_lost(left: list[Job], gone_since: dict[str, float], lost_after_s: float) -> None:
    """Raise JobLost for a job that left the queue lost_after_s ago without a result (submitit, without
    sacct, would wait for it forever); `gone_since` keeps what earlier calls saw."""
    queued = _in_queue([j.handle.job_id for j in left])
    now = time.monotonic()
    for job in left if queued is not None else ():
        jid = job.handle.job_id
        if jid in queued:
            gone_since.pop(jid, None)
        elif now - gone_since.setdefault(jid, now) > lost_after_s and not job.handle.done():
            raise JobLost(f"SLURM job {jid} {job.label} left the queue {lost_after_s:g} s ago without a "
                          f"result (scancel, node failure or time limit?); its log: {job.handle.paths.stdout}")


def _results(jobs: list[Job], kind: str, lost_after_s: float) -> list:
    import submitit

    from expgpu.procs import stop_signals

    gone_since: dict[str, float] = {}
    try:
        while True:
            left = [j for j in jobs if not j.handle.done()]
            if not left:
                break
            stopper = stop_signals.current()   # the CLI turns Ctrl-C / SIGTERM into a stop request
            if stopper is not None and stopper.received:
                raise KeyboardInterrupt
            if kind == "slurm":
                check_lost(left, gone_since, lost_after_s)
            time.sleep(1.0)
    except KeyboardInterrupt:
        ids = " ".join(j.handle.job_id for j in jobs if not j.handle.done())
        log.warning("interrupted: the jobs keep running; stop them with: scancel %s", ids)
        raise
    out = []
    for job in jobs:
        try:
            out.append(job.handle.results()[0])
        except submitit.core.utils.UncompletedJobError as e:
            raise JobLost(f"job {job.handle.job_id} {job.label} ended without a result: "
                          f"{str(e).splitlines()[0]}; its log: {job.handle.paths.stdout}") from None
    return out
