"""The environment a rank's script starts with: torchrun's variables and the GPU mask. Pure functions.

torchrun's contract (torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers):
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE,
TORCH_NCCL_ASYNC_ERROR_HANDLING. The script calls init_process_group() itself (env://).

- Under torchrun the rank already has them: passed through as torchrun set them.
- A world of one (not torchrun's) is `python train.py`: none of them. Scripts take RANK to mean
  "torchrun started me" (nanoGPT then asks for nccl and cuda:LOCAL_RANK), and alone they need no group.
- Otherwise (expgpu's spawn, srun, mpirun) they are made from the rank's RankInfo, with
  TORCHELASTIC_USE_AGENT_STORE=False: no agent hosts a store, rank 0's init_process_group does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from expgpu import envvars
from expgpu.errors import UserError
from expgpu.gpus import NodePlan
from expgpu.gpus.mask import gpu_env
from expgpu.ranks import RankInfo
from expgpu.ranks import local as local_source
from expgpu.script.log import ENV_RESUMED, ENV_RUN_DIR

# What expgpu's spawn tells its own workers: not the script's (a `python -m expgpu` it starts
# would take itself for one of expgpu's workers).
_NOT_PASSED = (*local_source.VARIABLES.values(), envvars.LAUNCH_ID, envvars.STOP_SIGNALS, envvars.SCRIPT_HEARTBEAT,
               envvars.SCRIPT_PROMPT)


def torchrun_variables(info: RankInfo, run_id: str, restarts: int) -> dict[str, str]:
    if info.source == "torchrun" or info.world_size == 1:
        return {}
    if info.master_port == 0:
        raise ValueError("a script's ranks need a MASTER_PORT chosen before they start")   # a bug, not a user's
    return {
        "RANK": str(info.rank), "LOCAL_RANK": str(info.local_rank),
        "WORLD_SIZE": str(info.world_size), "LOCAL_WORLD_SIZE": str(info.local_world_size),
        "GROUP_RANK": str(info.node_rank), "GROUP_WORLD_SIZE": str(info.num_nodes),
        "ROLE_RANK": str(info.rank), "ROLE_WORLD_SIZE": str(info.world_size), "ROLE_NAME": "default",
        "MASTER_ADDR": info.master_addr, "MASTER_PORT": str(info.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restarts), "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def visible_gpus(node: NodePlan, local_rank: int, isolation: str) -> tuple:
    """The GPUs a rank's script sees, in CUDA order. auto: every local rank's planned GPUs in local-rank
    order (rank r's at r*k .. r*k+k-1), so cuda:LOCAL_RANK is its own, as under torchrun; and no GPU
    the plan left out. visible_devices: only its own, as cuda:0 (for a script that uses plain cuda)."""
    if isolation == "visible_devices":
        return node.gpus_of(local_rank)
    node.gpus_of(local_rank)   # a local rank outside the plan: the same one line
    ordered = tuple(g for gpus in node.assignments for g in gpus)
    if len({g.index for g in ordered}) < len(ordered):
        raise UserError("gpu_map.share=true puts several ranks on one GPU, which one CUDA_VISIBLE_DEVICES for "
                        "all ranks cannot list (a GPU named twice); use launch.isolation=visible_devices "
                        "(each rank sees its own GPU as cuda:0: a script that uses plain cuda)")
    return ordered


def child_env(base: Mapping[str, str], info: RankInfo, node: NodePlan, isolation: str, *, run_dir: Path,
              launch_dir: str, module: bool, run_id: str, restarts: int, resumed: bool,
              prompt: str | None = None) -> dict[str, str]:
    """`base` (this rank's environment) with torchrun's variables, the GPU mask and what expgpu.log reads;
    `prompt`: the objective of a trial whose pruner judges rank 0's rows (expgpu.script.prune)."""
    env = {k: v for k, v in base.items() if k not in _NOT_PASSED}
    env.update(torchrun_variables(info, run_id, restarts))
    if env.keys() & {"WORLD_SIZE", "RANK"}:
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")   # torchrun's default
    env.update(gpu_env(visible_gpus(node, info.local_rank, isolation), base.get("CUDA_DEVICE_ORDER")))
    if module:   # python -m runs in the run dir: the module is found where the user launched from
        env["PYTHONPATH"] = os.pathsep.join(p for p in (launch_dir, base.get("PYTHONPATH")) if p)
    # Output through a pipe is block-buffered: lines would reach the console and the log in 8 KiB
    # lumps, and be lost at a SIGKILL.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[ENV_RUN_DIR] = str(Path(run_dir).absolute())
    env[ENV_RESUMED] = "1" if resumed else "0"
    if prompt:
        env[envvars.SCRIPT_PROMPT] = prompt
    return env
