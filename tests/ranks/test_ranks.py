"""Rank resolution: every source from an explicit env dict, the order between them, and the
one-line errors that name the bad variable."""

from __future__ import annotations

import dataclasses
import re

import pytest
from launcher_envs import linux_default_ports  # noqa: F401

from expgpu.errors import UserError
from expgpu.ranks import RankInfo, detect, slurm

pytestmark = pytest.mark.usefixtures("linux_default_ports")


def parse_env(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.split())


# --- environments seen on a real SLURM 22.05.8 (slurm-local), copied verbatim -----------------

# `sbatch -N1 --ntasks-per-node=2 job.sh`, the batch script itself: looks like rank 0 of 2,
# yet no rank 1 will ever come. No SLURM_STEP_ID.
BATCH_SCRIPT = parse_env("""
SLURMD_NODENAME=vm SLURM_CLUSTER_NAME=local SLURM_CONF=/tmp/slurm-ranks/slurm.conf SLURM_CPUS_ON_NODE=2
SLURM_GTIDS=0 SLURM_JOBID=1 SLURM_JOB_CPUS_PER_NODE=2 SLURM_JOB_GID=0 SLURM_JOB_ID=1 SLURM_JOB_NAME=inbatch
SLURM_JOB_NODELIST=vm SLURM_JOB_NUM_NODES=1 SLURM_JOB_PARTITION=debug SLURM_JOB_UID=0 SLURM_JOB_USER=root
SLURM_LOCALID=0 SLURM_NNODES=1 SLURM_NODEID=0 SLURM_NODELIST=vm SLURM_NODE_ALIASES=(null) SLURM_NPROCS=2
SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=2 SLURM_PRIO_PROCESS=0 SLURM_PROCID=0 SLURM_SUBMIT_DIR=/tmp/slurm-ranks/obs
SLURM_SUBMIT_HOST=vm SLURM_TASKS_PER_NODE=2 SLURM_TASK_PID=3400 SLURM_TOPOLOGY_ADDR=vm
SLURM_TOPOLOGY_ADDR_PATTERN=node SLURM_WORKING_CLUSTER=local:127.0.0.1:6917:9728:109
""")

# `sbatch --wrap 'env'`: the same, one task.
WRAP_SCRIPT = parse_env("""
SLURMD_NODENAME=vm SLURM_CLUSTER_NAME=local SLURM_CONF=/tmp/slurm-ranks/slurm.conf SLURM_CPUS_ON_NODE=1
SLURM_GTIDS=0 SLURM_JOBID=2 SLURM_JOB_CPUS_PER_NODE=1 SLURM_JOB_GID=0 SLURM_JOB_ID=2 SLURM_JOB_NAME=wrap
SLURM_JOB_NODELIST=vm SLURM_JOB_NUM_NODES=1 SLURM_JOB_PARTITION=debug SLURM_JOB_UID=0 SLURM_JOB_USER=root
SLURM_LOCALID=0 SLURM_NNODES=1 SLURM_NODEID=0 SLURM_NODELIST=vm SLURM_NODE_ALIASES=(null) SLURM_PRIO_PROCESS=0
SLURM_PROCID=0 SLURM_SUBMIT_DIR=/tmp/slurm-ranks/obs SLURM_SUBMIT_HOST=vm SLURM_TASKS_PER_NODE=1
SLURM_TASK_PID=3453 SLURM_TOPOLOGY_ADDR=vm SLURM_TOPOLOGY_ADDR_PATTERN=node
SLURM_WORKING_CLUSTER=local:127.0.0.1:6917:9728:109
""")

# `salloc -n2 bash -c ...`: the shell of an allocation, no SLURM_PROCID, no step id.
SALLOC_SHELL = parse_env("""
SLURM_CLUSTER_NAME=local SLURM_CONF=/tmp/slurm-ranks/slurm.conf SLURM_JOBID=4 SLURM_JOB_CPUS_PER_NODE=2
SLURM_JOB_ID=4 SLURM_JOB_NAME=interactive SLURM_JOB_NODELIST=vm SLURM_JOB_NUM_NODES=1 SLURM_JOB_PARTITION=debug
SLURM_NNODES=1 SLURM_NODELIST=vm SLURM_NODE_ALIASES=(null) SLURM_NPROCS=2 SLURM_NTASKS=2
SLURM_SUBMIT_DIR=/tmp/slurm-ranks/obs SLURM_SUBMIT_HOST=vm SLURM_TASKS_PER_NODE=2
""")

# salloc's interactive step (`srun --interactive`, what LaunchParameters=use_interactive_step runs):
# rank 0 of 2 again, but SLURM_STEP_ID is the pseudo id SLURM_INTERACTIVE_STEP = 0xfffffffa.
INTERACTIVE_STEP = parse_env("""
SLURMD_NODENAME=vm SLURM_CLUSTER_NAME=local SLURM_CONF=/tmp/slurm-ranks/slurm.conf SLURM_CPUS_ON_NODE=2
SLURM_GTIDS=0 SLURM_JOBID=12 SLURM_JOB_CPUS_PER_NODE=2 SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0=2 SLURM_JOB_GID=0
SLURM_JOB_ID=12 SLURM_JOB_NAME=interactive SLURM_JOB_NODELIST=vm SLURM_JOB_NUM_NODES=1 SLURM_JOB_PARTITION=debug
SLURM_JOB_UID=0 SLURM_JOB_USER=root SLURM_LAUNCH_NODE_IPADDR=127.0.0.1 SLURM_LOCALID=0 SLURM_MPI_TYPE=none
SLURM_NNODES=1 SLURM_NODEID=0 SLURM_NODELIST=vm SLURM_NODE_ALIASES=(null) SLURM_NPROCS=2 SLURM_NTASKS=2
SLURM_PRIO_PROCESS=0 SLURM_PROCID=0 SLURM_SRUN_COMM_HOST=127.0.0.1 SLURM_SRUN_COMM_PORT=40931
SLURM_STEPID=4294967290 SLURM_STEP_ID=4294967290 SLURM_STEP_LAUNCHER_PORT=40931 SLURM_STEP_NODELIST=vm
SLURM_STEP_NUM_NODES=1 SLURM_STEP_NUM_TASKS=1 SLURM_STEP_TASKS_PER_NODE=1 SLURM_SUBMIT_DIR=/tmp/slurm-ranks/obs
SLURM_SUBMIT_HOST=vm SLURM_TASKS_PER_NODE=2 SLURM_TASK_PID=4772 SLURM_TOPOLOGY_ADDR=vm
SLURM_TOPOLOGY_ADDR_PATTERN=node SLURM_WORKING_CLUSTER=local:127.0.0.1:6917:9728:109
""")

# `srun` inside that sbatch job: task 1 of step 0.
SRUN_STEP_IN_BATCH = parse_env("""
SLURMD_NODENAME=vm SLURM_CLUSTER_NAME=local SLURM_CONF=/tmp/slurm-ranks/slurm.conf SLURM_CPUS_ON_NODE=2
SLURM_DISTRIBUTION=block SLURM_GTIDS=0,1 SLURM_JOBID=1 SLURM_JOB_CPUS_PER_NODE=2
SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0=2 SLURM_JOB_GID=0 SLURM_JOB_ID=1 SLURM_JOB_NAME=inbatch SLURM_JOB_NODELIST=vm
SLURM_JOB_NUM_NODES=1 SLURM_JOB_PARTITION=debug SLURM_JOB_UID=0 SLURM_JOB_USER=root
SLURM_LAUNCH_NODE_IPADDR=127.0.0.1 SLURM_LOCALID=1 SLURM_NNODES=1 SLURM_NODEID=0 SLURM_NODELIST=vm
SLURM_NODE_ALIASES=(null) SLURM_NPROCS=2 SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=2 SLURM_PRIO_PROCESS=0
SLURM_PROCID=1 SLURM_SRUN_COMM_HOST=127.0.0.1 SLURM_SRUN_COMM_PORT=38325 SLURM_STEPID=0 SLURM_STEP_ID=0
SLURM_STEP_LAUNCHER_PORT=38325 SLURM_STEP_NODELIST=vm SLURM_STEP_NUM_NODES=1 SLURM_STEP_NUM_TASKS=2
SLURM_STEP_TASKS_PER_NODE=2 SLURM_SUBMIT_DIR=/tmp/slurm-ranks/obs SLURM_SUBMIT_HOST=vm SLURM_TASKS_PER_NODE=2
SLURM_TASK_PID=3420 SLURM_TOPOLOGY_ADDR=vm SLURM_TOPOLOGY_ADDR_PATTERN=node SLURM_UMASK=0022
SLURM_WORKING_CLUSTER=local:127.0.0.1:6917:9728:109
""")

# `srun -n2` on its own (no sbatch): task 0.
PLAIN_SRUN = parse_env("""
SLURMD_NODENAME=vm SLURM_CLUSTER_NAME=local SLURM_CONF=/tmp/slurm-ranks/slurm.conf SLURM_CPUS_ON_NODE=2
SLURM_GTIDS=0,1 SLURM_JOBID=3 SLURM_JOB_CPUS_PER_NODE=2 SLURM_JOB_GID=0 SLURM_JOB_ID=3 SLURM_JOB_NAME=bash
SLURM_JOB_NODELIST=vm SLURM_JOB_NUM_NODES=1 SLURM_JOB_PARTITION=debug SLURM_JOB_UID=0 SLURM_JOB_USER=root
SLURM_LAUNCH_NODE_IPADDR=127.0.0.1 SLURM_LOCALID=0 SLURM_NNODES=1 SLURM_NODEID=0 SLURM_NODELIST=vm SLURM_NPROCS=2
SLURM_NTASKS=2 SLURM_PRIO_PROCESS=0 SLURM_PROCID=0 SLURM_SRUN_COMM_HOST=127.0.0.1 SLURM_SRUN_COMM_PORT=37795
SLURM_STEPID=0 SLURM_STEP_ID=0 SLURM_STEP_LAUNCHER_PORT=37795 SLURM_STEP_NODELIST=vm SLURM_STEP_NUM_NODES=1
SLURM_STEP_NUM_TASKS=2 SLURM_STEP_TASKS_PER_NODE=2 SLURM_SUBMIT_DIR=/tmp/slurm-ranks/obs SLURM_SUBMIT_HOST=vm
SLURM_TASKS_PER_NODE=2 SLURM_TASK_PID=3485 SLURM_TOPOLOGY_ADDR=vm SLURM_TOPOLOGY_ADDR_PATTERN=node
SLURM_UMASK=0022 SLURM_WORKING_CLUSTER=local:127.0.0.1:6917:9728:109
""")

# --- hand-made, well-formed environments ---------------------------------------------------------

# Task 5 of 7 on the third of four nodes (2, 2, 2, 1 tasks), as srun would write it.
SLURM_4_NODES = {
    "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456", "SLURM_PROCID": "5", "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_NNODES": "4", "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_JOB_NODELIST": "gpu-[001-003,010]",
}
TORCHRUN = {  # torchrun --nnodes=2 --nproc-per-node=2, worker 3
    "TORCHELASTIC_RUN_ID": "none", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400",
}
LOCAL = {
    "EXPGPU_RANK": "2", "EXPGPU_LOCAL_RANK": "2", "EXPGPU_WORLD_SIZE": "4", "EXPGPU_LOCAL_WORLD_SIZE": "4",
    "EXPGPU_NODE_RANK": "0", "EXPGPU_MASTER_ADDR": "127.0.0.1", "EXPGPU_MASTER_PORT": "41234",
}
OPEN_MPI = {  # mpirun -np 8 on 2 nodes, -x MASTER_ADDR
    "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1",
}
MPICH = {  # Hydra mpiexec -n 4 -ppn 2
    "PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
    "MASTER_ADDR": "head", "MASTER_PORT": "23456",
}


def info(rank, local_rank, world, local_world, node, addr, port, source, num_nodes=0):
    return RankInfo(rank, local_rank, world, local_world, node, addr, port, source, num_nodes)


WELL_FORMED = {
    "empty env": ({}, info(0, 0, 1, 1, 0, "127.0.0.1", 0, "single")),
    "local spawn": (LOCAL, info(2, 2, 4, 4, 0, "127.0.0.1", 41234, "local")),
    "torchrun": (TORCHRUN, info(3, 1, 4, 2, 1, "node0", 29400, "torchrun", 2)),
    "torchrun --standalone": (
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
         "GROUP_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "36257"},
        info(0, 0, 1, 1, 0, "localhost", 36257, "torchrun", 1),
    ),
    "env:// without per-node variables": (
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, info(1, 1, 2, 2, 0, "h", 29500, "torchrun", 1),
    ),
    "env:// with LOCAL_*, no GROUP_RANK": (
        {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "h",
         "MASTER_PORT": "1234"},
        info(5, 2, 6, 3, 1, "h", 1234, "torchrun", 2),
    ),
    "slurm 4 nodes": (SLURM_4_NODES, info(5, 1, 7, 2, 2, "gpu-001", 15000 + 123456 % 17768, "slurm", 4)),
    "slurm last node, 1 task": (
        {**SLURM_4_NODES, "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"},
        info(6, 0, 7, 1, 3, "gpu-001", 31848, "slurm", 4),
    ),
    "srun step in sbatch (real)": (SRUN_STEP_IN_BATCH, info(1, 1, 2, 2, 0, "vm", 15001, "slurm", 1)),
    "plain srun -n2 (real)": (PLAIN_SRUN, info(0, 0, 2, 2, 0, "vm", 15003, "slurm", 1)),
    "open mpi": (OPEN_MPI, info(6, 2, 8, 4, 1, "10.0.0.1", 29500, "mpi", 2)),
    "mpich / intel mpi": (MPICH, info(1, 1, 4, 2, 0, "head", 23456, "mpi", 2)),
    # launch/spawn.py's contract: port 0 = rank 0 binds a free port and publishes it in the run dir
    "local spawn, port chosen later": (
        {**LOCAL, "EXPGPU_MASTER_PORT": "0"}, info(2, 2, 4, 4, 0, "127.0.0.1", 0, "local")),
    # one rank of one (a warm server's fork): a single process's run, as the user launched it
    "local single child, port 0": (
        {**LOCAL, "EXPGPU_RANK": "0", "EXPGPU_LOCAL_RANK": "0", "EXPGPU_WORLD_SIZE": "1",
         "EXPGPU_LOCAL_WORLD_SIZE": "1", "EXPGPU_MASTER_PORT": "0"},
        info(0, 0, 1, 1, 0, "127.0.0.1", 0, "single"),
    ),
    "mpi, 1 process, no MASTER_ADDR": (
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
        info(0, 0, 1, 1, 0, "127.0.0.1", 29500, "mpi", 1),
    ),
    "pmi without local variables": (
        {"PMI_RANK": "2", "PMI_SIZE": "3", "MASTER_ADDR": "h"}, info(2, 2, 3, 3, 0, "h", 29500, "mpi", 1),
    ),
}


@pytest.mark.parametrize("env, expected", WELL_FORMED.values(), ids=WELL_FORMED.keys())
def test_well_formed(env, expected):
    got = detect(env)
    assert got == expected  # all fields, num_nodes included
    assert got.as_dict() == dataclasses.asdict(expected)


def test_rank_info_is_frozen_and_derives_num_nodes():
    r = info(3, 1, 8, 4, 0, "h", 1, "torchrun")
    assert r.num_nodes == 2
    assert set(r.as_dict()) == {f.name for f in dataclasses.fields(RankInfo)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.rank = 0


# --- precedence -------------------------------------------------------------------------------

PRECEDENCE = {
    "local beats torchrun, slurm, mpi": ({**OPEN_MPI, **SLURM_4_NODES, **TORCHRUN, **LOCAL}, "local"),
    "local inside an srun step": ({**SRUN_STEP_IN_BATCH, **LOCAL}, "local"),
    "torchrun beats slurm and mpi": ({**OPEN_MPI, **SLURM_4_NODES, **TORCHRUN}, "torchrun"),
    # torchrun started by `srun -n1` (seen on slurm-local: workers get rank 0 and 1 of 2)
    "torchrun inside an srun step": (
        {**PLAIN_SRUN, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1", **TORCHRUN}, "torchrun"),
    "slurm beats mpi": ({**OPEN_MPI, **SLURM_4_NODES}, "slurm"),
    "open mpi beats pmi": ({**MPICH, **OPEN_MPI}, "mpi"),
}


@pytest.mark.parametrize("env, source", PRECEDENCE.values(), ids=PRECEDENCE.keys())
def test_precedence(env, source):
    assert detect(env).source == source


def test_the_winner_ignores_broken_variables_of_outer_launchers():
    # An srun step's leftovers must not break the local child that inherits them.
    assert detect({**SLURM_4_NODES, "SLURM_PROCID": "99", **LOCAL}).rank == 2


def test_open_mpi_node_rank_variable_is_not_a_node_index():
    # OMPI_COMM_WORLD_NODE_RANK counts processes on this node; node 1 here, not 2.
    assert detect(OPEN_MPI).node_rank == 1


# --- an allocation that is not an srun step is a single process ----------------------------

NOT_A_STEP = {
    "sbatch batch script": BATCH_SCRIPT,
    "sbatch --wrap": WRAP_SCRIPT,
    "salloc shell": SALLOC_SHELL,
    "salloc interactive step": INTERACTIVE_STEP,
    "batch pseudo step id": {**SRUN_STEP_IN_BATCH, "SLURM_STEP_ID": "4294967291", "SLURM_STEPID": "4294967291"},
    "extern pseudo step id": {**SRUN_STEP_IN_BATCH, "SLURM_STEP_ID": "4294967292", "SLURM_STEPID": "4294967292"},
}


@pytest.mark.parametrize("env", NOT_A_STEP.values(), ids=NOT_A_STEP.keys())
def test_not_an_srun_step_is_single(env):
    assert detect(env) == info(0, 0, 1, 1, 0, "127.0.0.1", 0, "single")


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"WORLD_SIZE": "1"}, {"LOCAL_RANK": "0"},
                                 {"EXPGPU_RANK": ""}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}])
def test_stray_variables_are_not_a_launcher(env):
    assert detect(env).source == "single"


def test_old_slurm_step_variable_alone_is_enough():
    env = {k: v for k, v in SRUN_STEP_IN_BATCH.items() if k != "SLURM_STEP_ID"}
    assert detect(env).source == "slurm"


# --- host lists and tasks per node --------------------------------------------------------------

HOSTLISTS = {
    "gpu-[001-003,010],cpu7": ["gpu-001", "gpu-002", "gpu-003", "gpu-010", "cpu7"],
    "node[1-2]": ["node1", "node2"],
    "a,b": ["a", "b"],
    "n[9-11]": ["n9", "n10", "n11"],
    "rack[1-2]-n[08-09]": ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"],
    "n[001-002,7]": ["n001", "n002", "n7"],
}


@pytest.mark.parametrize("raw, expected", HOSTLISTS.items(), ids=HOSTLISTS.keys())
def test_host_lists(raw, expected):
    assert slurm.hosts({"SLURM_JOB_NODELIST": raw}) == ("SLURM_JOB_NODELIST", expected)
    n = len(expected)
    env = {**SLURM_4_NODES, "SLURM_JOB_NODELIST": raw, "SLURM_NNODES": str(n), "SLURM_NTASKS": str(n),
           "SLURM_TASKS_PER_NODE": f"1(x{n})", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert detect(env).master_addr == expected[0]


def test_step_nodelist_wins_over_the_jobs():
    # A step on part of a multi-node job: SLURM_JOB_NODELIST keeps every node of the job.
    env = {**SLURM_4_NODES, "SLURM_JOB_NODELIST": "big[1-8]", "SLURM_STEP_NODELIST": "big[5-8]"}
    assert detect(env).master_addr == "big5"


@pytest.mark.parametrize("raw", ["gpu-[001-", "n[3-1]", "a[]", "n[1-2"])
def test_malformed_host_list_names_the_variable(raw):
    with pytest.raises(UserError, match=r"^SLURM_JOB_NODELIST='" + re.escape(raw) + "' is not a SLURM host list"):
        detect({**SLURM_4_NODES, "SLURM_JOB_NODELIST": raw})


@pytest.mark.parametrize("raw, expected", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1(x2)", [1, 1])])
def test_tasks_per_node(raw, expected):
    assert slurm.tasks_per_node({"SLURM_TASKS_PER_NODE": raw}) == expected


@pytest.mark.parametrize("raw", ["2(x", "-1", "a", "2(x0)", "0", "2,,1"])
def test_malformed_tasks_per_node_names_the_variable(raw):
    with pytest.raises(UserError, match=r"^SLURM_TASKS_PER_NODE='" + re.escape(raw) + "'"):
        detect({**SLURM_4_NODES, "SLURM_TASKS_PER_NODE": raw})


# --- every malformed value names its variable -------------------------------------------------

MALFORMED = {
    # slurm
    "slurm procid not int": (SLURM_4_NODES, {"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
    "slurm procid underscore": (SLURM_4_NODES, {"SLURM_PROCID": "1_0"}, "SLURM_PROCID='1_0' is not an integer"),
    "slurm procid negative": (SLURM_4_NODES, {"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1' must be >= 0"),
    "slurm procid >= ntasks": (SLURM_4_NODES, {"SLURM_PROCID": "7"}, "SLURM_PROCID='7' must be < SLURM_NTASKS=7"),
    "slurm ntasks zero": (SLURM_4_NODES, {"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' must be >= 1"),
    "slurm procid missing": (SLURM_4_NODES, {"SLURM_PROCID": None}, "SLURM_PROCID is not set"),
    "slurm step id not int": (SLURM_4_NODES, {"SLURM_STEP_ID": "batch"}, "SLURM_STEP_ID='batch' is not an integer"),
    "slurm localid too large": (
        SLURM_4_NODES, {"SLURM_LOCALID": "2"},
        "SLURM_LOCALID='2' must be < 2, the tasks of node 2 in SLURM_TASKS_PER_NODE='2(x3),1'"),
    "slurm localid on the 1-task node": (
        SLURM_4_NODES, {"SLURM_NODEID": "3", "SLURM_PROCID": "6"}, "SLURM_LOCALID='1' must be < 1"),
    "slurm nodeid >= nnodes": (SLURM_4_NODES, {"SLURM_NODEID": "4"}, "SLURM_NODEID='4' must be < SLURM_NNODES=4"),
    "slurm tasks sum != ntasks": (
        SLURM_4_NODES, {"SLURM_NTASKS": "8"},
        "SLURM_TASKS_PER_NODE='2(x3),1' sums to 7 tasks but SLURM_NTASKS=8"),
    "slurm tasks nodes != nnodes": (
        SLURM_4_NODES, {"SLURM_TASKS_PER_NODE": "2(x2),3"},
        "SLURM_TASKS_PER_NODE='2(x2),3' gives 3 nodes but SLURM_NNODES=4"),
    "slurm 1 host != nnodes": (SLURM_4_NODES, {"SLURM_JOB_NODELIST": "n1"}, "='n1' lists 1 host but SLURM_NNODES=4"),
    "slurm hosts != nnodes": (
        SLURM_4_NODES, {"SLURM_JOB_NODELIST": "gpu-[001-003]"},
        "SLURM_JOB_NODELIST='gpu-[001-003]' lists 3 hosts but SLURM_NNODES=4"),
    "slurm step hosts != nnodes": (
        SLURM_4_NODES, {"SLURM_STEP_NODELIST": "a,b"}, "SLURM_STEP_NODELIST='a,b' lists 2 hosts but SLURM_NNODES=4"),
    "slurm nodelist missing": (SLURM_4_NODES, {"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    "slurm job id not int": (SLURM_4_NODES, {"SLURM_JOB_ID": "12_3"}, "SLURM_JOB_ID='12_3' is not an integer"),
    "slurm master port too big": (SLURM_4_NODES, {"MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be a TCP port"),
    "torchrun master port zero": (TORCHRUN, {"MASTER_PORT": "0"}, "MASTER_PORT='0' must be a TCP port in 1..65535"),
    "slurm master port zero": (SLURM_4_NODES, {"MASTER_PORT": "0"}, "MASTER_PORT='0' must be a TCP port in 1..65535"),
    # torchrun
    "torchrun rank >= world": (TORCHRUN, {"RANK": "4"}, "RANK='4' must be < WORLD_SIZE=4"),
    "torchrun rank not int": (TORCHRUN, {"RANK": "one"}, "RANK='one' is not an integer"),
    "torchrun rank missing": (TORCHRUN, {"RANK": None}, "RANK is not set"),
    "torchrun local rank too large": (TORCHRUN, {"LOCAL_RANK": "2"}, "LOCAL_RANK='2' must be < LOCAL_WORLD_SIZE=2"),
    "torchrun local world > world": (
        TORCHRUN, {"LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE='5' must be <= WORLD_SIZE=4"),
    "torchrun local world missing": (TORCHRUN, {"LOCAL_WORLD_SIZE": None}, "LOCAL_WORLD_SIZE is not set"),
    "torchrun group rank too large": (TORCHRUN, {"GROUP_RANK": "2"}, "GROUP_RANK='2' must be < GROUP_WORLD_SIZE=2"),
    "torchrun master addr missing": (TORCHRUN, {"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
    "torchrun master port negative": (TORCHRUN, {"MASTER_PORT": "-5"}, "MASTER_PORT='-5' must be a TCP port in 1."),
    "torchrun master port huge": (TORCHRUN, {"MASTER_PORT": "65536"}, "MASTER_PORT='65536' must be a TCP port"),
    "torchrun master port text": (TORCHRUN, {"MASTER_PORT": "http"}, "MASTER_PORT='http' must be a TCP port in 1."),
    # local
    "local rank >= world": (LOCAL, {"EXPGPU_RANK": "4"}, "EXPGPU_RANK='4' must be < EXPGPU_WORLD_SIZE=4"),
    "local local rank too large": (
        LOCAL, {"EXPGPU_LOCAL_WORLD_SIZE": "2"}, "EXPGPU_LOCAL_RANK='2' must be < EXPGPU_LOCAL_WORLD_SIZE=2"),
    "local port missing": (LOCAL, {"EXPGPU_MASTER_PORT": None}, "EXPGPU_MASTER_PORT is not set"),
    "local port too big": (LOCAL, {"EXPGPU_MASTER_PORT": "65536"}, "EXPGPU_MASTER_PORT='65536' must be a TCP port"),
    "local addr with space": (
        LOCAL, {"EXPGPU_MASTER_ADDR": "a b"}, "EXPGPU_MASTER_ADDR='a b' must be a host name or IP address"),
    "local world zero": (LOCAL, {"EXPGPU_WORLD_SIZE": "0"}, "EXPGPU_WORLD_SIZE='0' must be >= 1"),
    # mpi
    "ompi rank >= size": (
        OPEN_MPI, {"OMPI_COMM_WORLD_RANK": "8"}, "OMPI_COMM_WORLD_RANK='8' must be < OMPI_COMM_WORLD_SIZE=8"),
    "ompi local rank too large": (
        OPEN_MPI, {"OMPI_COMM_WORLD_LOCAL_RANK": "4"},
        "OMPI_COMM_WORLD_LOCAL_RANK='4' must be < OMPI_COMM_WORLD_LOCAL_SIZE=4"),
    "ompi local size > size": (
        OPEN_MPI, {"OMPI_COMM_WORLD_LOCAL_SIZE": "9"},
        "OMPI_COMM_WORLD_LOCAL_SIZE='9' must be <= OMPI_COMM_WORLD_SIZE=8"),
    "mpi needs MASTER_ADDR": (OPEN_MPI, {"MASTER_ADDR": None}, "MASTER_ADDR is not set, and an MPI launch of 8"),
    "pmi size not int": (MPICH, {"PMI_SIZE": "4.0"}, "PMI_SIZE='4.0' is not an integer"),
    "pmi local rank negative": (MPICH, {"MPI_LOCALRANKID": "-1"}, "MPI_LOCALRANKID='-1' must be >= 0"),
    "pmi bad port": (MPICH, {"MASTER_PORT": "99999"}, "MASTER_PORT='99999' must be a TCP port in 1..65535"),
}


@pytest.mark.parametrize("base, changes, message", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_values_name_the_variable(base, changes, message):
    env = {**base, **changes}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(UserError) as caught:
        detect(env)
    text = str(caught.value)
    assert message in text
    assert "\n" not in text


# --- MASTER_PORT for SLURM ------------------------------------------------------------------
# (the range it comes from, and nodes whose ephemeral range covers it: test_rank_layouts.py)

@pytest.mark.parametrize("job_id, port", [("1", 15001), ("123456", 31848), ("17767", 32767), ("17768", 15000)])
def test_slurm_port_derives_from_job_id(job_id, port):
    assert detect({**SLURM_4_NODES, "SLURM_JOB_ID": job_id}).master_port == port


def test_slurm_port_and_addr_from_env_win():
    got = detect({**SLURM_4_NODES, "MASTER_PORT": "29999", "MASTER_ADDR": "10.1.2.3"})
    assert (got.master_addr, got.master_port) == ("10.1.2.3", 29999)


def test_slurm_port_override_needs_no_job_id():
    env = {k: v for k, v in SLURM_4_NODES.items() if k != "SLURM_JOB_ID"}
    assert detect({**env, "MASTER_PORT": "29999"}).master_port == 29999
    with pytest.raises(UserError, match="SLURM_JOB_ID is not set"):
        detect(env)
