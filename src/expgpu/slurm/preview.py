"""The dry run of `hydra/launcher=slurm`: the sbatch script submitit would submit, and each job's plan.

The script comes from submitit's own renderer (the function its SlurmExecutor writes submission files
with), fed the parameters the launcher would give it, so the preview is what sbatch would receive;
it needs no SLURM on this machine. The plan is the job's gpu_map applied to the GPUs the job asks for:
inventory.simulate when set, else `gpus_per_node` GPUs of unknown kind (SLURM picks which at run time).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Mapping

from expgpu.slurm.resources import Resources


def sbatch_script(params: Mapping, folder: str, array: int, python: str | None = None) -> str:
    """`params`: hydra.launcher's unprefixed submitit parameters (timeout_min, tasks_per_node, partition...)."""
    from submitit.slurm import slurm as submitit_slurm

    renames = submitit_slurm.SlurmExecutor._equivalence_dict()
    args = {}
    for key, value in params.items():
        if value is None:
            continue   # submitit's AutoExecutor treats None as unset
        key = renames.get(key, key)
        args[key] = submitit_slurm._convert_mem(value) if key == "mem" else value
    if array > 1:
        args["map_count"] = array
    folder = str(Path(folder).expanduser().absolute())   # as submitit's executors hold it
    command = " ".join([python or shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(folder)])
    return submitit_slurm._make_sbatch_string(command=command, folder=folder, **args)


def plan_table(cfg: Mapping, res: Resources, script: Mapping | None = None) -> str:
    """`cfg`: the job's resolved gpu_map, launch and inventory sections; `script`: a script task's
    ScriptSpec (as a dict), whose command and GPU mask each rank gets are listed after the plan."""
    from expgpu.gpus import inventory, placement, plan

    if res.gpus_per_node is None:
        return "plan: made in the job, from the GPUs the gres / gpus_per_task request gives each node"
    simulate = cfg["inventory"]["simulate"]
    if simulate is not None:
        gpus, unknown = inventory(simulate, env={})[:res.gpus_per_node], False
    else:
        gpus, unknown = inventory([{"name": "?", "memory_mb": 1}] * res.gpus_per_node, env={}), True
    node = plan(gpus, res.ranks_per_node, placement.gpu_map_params(cfg))
    rows, commands = [], []
    for node_rank in range(res.nodes):
        first = node_rank * res.ranks_per_node  # submitit's srun: block, as many tasks on every node
        for row in placement.rows(node, range(first, first + res.ranks_per_node), host=f"node{node_rank}"):
            if unknown:
                row.update(names=["?"] * len(row["gpus"]), memory_mb=[], scores=[])
            rows.append(row)
        if script is not None:
            commands += _commands(script, cfg, node, range(first, first + res.ranks_per_node))
    note = ("" if not res.gpus_per_node else
            "\n(GPU: the job's GPUs in CUDA order, numbered from 0 on each node; SLURM picks which of the node's)")
    if commands:
        note += "\neach rank runs, in its job's run dir:\n" + "\n".join(commands)
    return placement.table(rows, node.strategy) + note


def _commands(script: Mapping, cfg: Mapping, node, labels) -> list[str]:
    from expgpu.script import runner
    from expgpu.script.spec import ScriptSpec

    return runner.commands(ScriptSpec.from_dict(dict(script)), cfg, node, list(labels))


def memory_lines(jobs) -> dict[int, str]:
    """job.num -> what each of the job's ranks will hold for parameters and optimizer state (ddp
    and fsdp); every distinct model of the sweep counted once."""
    from expgpu.gpus import memory_estimate
    from expgpu.pool.job_config import resolved

    tasks = [resolved(job.cfg, "task") for job in jobs]
    estimates = memory_estimate.measure_many(tasks)
    return {job.num: memory_estimate.line(est, job.res.nodes * job.res.ranks_per_node)
            for job, est in zip(jobs, estimates)}
