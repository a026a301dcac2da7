"""Where each rank sits, checked against what the launchers themselves write: srun steps (srun -E in
a larger allocation, block / cyclic / plane, uneven counts), torchrun with different workers per
node, the refusals, and the MASTER_PORT a SLURM job derives."""

from __future__ import annotations

import pytest
from launcher_envs import (
    BLOCK_NODE1,
    CYCLIC_NODE0,
    CYCLIC_NODE1,
    PLANE2_NODE0,
    SRUN_E,
    TORCHRUN_2_PLUS_1_NODE0,
    TORCHRUN_2_PLUS_1_NODE1,
    UNEVEN_2_1,
    linux_default_ports,  # noqa: F401
)

from conftest import clean_env, expgpu
from expgpu.errors import UserError
from expgpu.ranks import RankInfo, detect, slurm

pytestmark = pytest.mark.usefixtures("linux_default_ports")


JOB1_PORT = 15001  # 15000 + SLURM_JOB_ID 1


def slurm_info(rank, local_rank, world, local_world, node, num_nodes, ranks_on_node, addr="localhost"):
    return RankInfo(rank, local_rank, world, local_world, node, addr, JOB1_PORT, "slurm", num_nodes,
                    ranks_on_node)


REAL_STEPS = {
    "srun -E, 2-task step in a 5-task allocation": (SRUN_E, slurm_info(1, 1, 2, 2, 0, 1, (0, 1))),
    "cyclic, node 0": (CYCLIC_NODE0, slurm_info(2, 1, 5, 4, 0, 2, (0, 2, 3, 4))),
    "cyclic, node 1": (CYCLIC_NODE1, slurm_info(1, 0, 5, 1, 1, 2, (1,))),
    "plane=2, node 0": (PLANE2_NODE0, slurm_info(3, 2, 5, 4, 0, 2, (0, 1, 3, 4))),
    "block 4,1, node 1": (BLOCK_NODE1, slurm_info(4, 0, 5, 1, 1, 2, (4,))),
    "block 2,1, node 1": (UNEVEN_2_1, slurm_info(2, 0, 3, 1, 1, 2, (2,))),
}


@pytest.mark.parametrize("env, expected", REAL_STEPS.values(), ids=REAL_STEPS.keys())
def test_real_srun_steps(env, expected):
    assert detect(env) == expected


@pytest.mark.parametrize("env, expected", REAL_STEPS.values(), ids=REAL_STEPS.keys())
def test_layout_without_slurm_gtids_is_the_one_slurmstepd_wrote(env, expected):
    # A site may strip SLURM_GTIDS (some third-party codes trip on it): SLURM_DISTRIBUTION over the
    # step's task counts must give the same ranks.
    stripped = {k: v for k, v in env.items() if k != "SLURM_GTIDS"}
    assert detect(stripped) == expected


def test_srun_e_no_longer_waits_for_the_allocations_world():
    # The case: `sbatch -n8`, then `srun -E -n2`: SLURM_NTASKS stays 8.
    env = {**SRUN_E, "SLURM_NTASKS": "8", "SLURM_NPROCS": "8", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "8",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1"}
    got = detect(env)
    assert (got.world_size, got.local_world_size, got.ranks_on_node) == (2, 2, (0, 1))


def test_step_on_part_of_the_nodes_under_srun_e():
    # `sbatch -N4 --ntasks-per-node=2`, then `srun -E -N2 -n3 -r2` on nodes 3 and 4 (block: 2,1).
    env = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "1", "SLURM_GTIDS": "2", "SLURM_NTASKS": "8", "SLURM_NNODES": "4",
           "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_STEP_NUM_TASKS": "3",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "n[3-4]"}
    assert detect(env) == RankInfo(2, 0, 3, 1, 1, "n3", 15077, "slurm", 2, (2,))


# --- srun(1)'s own example, SLURM_TASKS_PER_NODE=2(x3),1: every task of both layouts ------------

TASKS_2X3_1 = {  # node -> ranks, as slurmstepd writes SLURM_GTIDS
    "block": [(0, 1), (2, 3), (4, 5), (6,)],
    "cyclic": [(0, 4), (1, 5), (2, 6), (3,)],
    "plane=2": [(0, 1), (2, 3), (4, 5), (6,)],  # 2 per turn, then each node is full
}


def uneven_env(distribution: str, node: int, local: int, gtids: tuple[int, ...], with_gtids: bool) -> dict:
    method, _, size = distribution.partition("=")
    env = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456", "SLURM_PROCID": str(gtids[local]),
           "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), "SLURM_STEP_NUM_TASKS": "7",
           "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
           "SLURM_STEP_NODELIST": "gpu-[001-003,010]", "SLURM_DISTRIBUTION": method}
    if size:
        env["SLURM_DIST_PLANESIZE"] = size
    if with_gtids:
        env["SLURM_GTIDS"] = ",".join(map(str, gtids))
    return env


@pytest.mark.parametrize("with_gtids", [True, False], ids=["SLURM_GTIDS", "layout"])
@pytest.mark.parametrize("distribution", TASKS_2X3_1)
def test_uneven_2x3_1_every_task(distribution, with_gtids):
    seen = []
    for node, gtids in enumerate(TASKS_2X3_1[distribution]):
        for local in range(len(gtids)):
            got = detect(uneven_env(distribution, node, local, gtids, with_gtids))
            assert (got.node_rank, got.local_rank, got.local_world_size) == (node, local, len(gtids))
            assert got.ranks_on_node == gtids and got.world_size == 7 and got.num_nodes == 4
            assert got.master_addr == "gpu-001"  # task 0's node in every layout
            seen.append(got.rank)
    assert sorted(seen) == list(range(7))


@pytest.mark.parametrize("counts, chunk, expected", [
    ([3, 2], 1, [(0, 2, 4), (1, 3)]),
    ([3, 2], 3, [(0, 1, 2), (3, 4)]),
    ([4, 1], 1, [(0, 2, 3, 4), (1,)]),
    ([4, 4], 3, [(0, 1, 2, 6), (3, 4, 5, 7)]),    # srun's plane layout with plane_size=3
    ([1, 1, 1], 1, [(0,), (1,), (2,)]),
])
def test_dealt(counts, chunk, expected):
    assert slurm.dealt(counts, chunk) == expected


# --- SLURM refusals: one line naming the variable -----------------------------------------------

SLURM_REFUSALS = {
    "step tasks vs step counts": (
        SRUN_E, {"SLURM_STEP_NUM_TASKS": "3"},
        "SLURM_STEP_TASKS_PER_NODE='2' sums to 2 tasks but SLURM_STEP_NUM_TASKS=3"),
    "step nodes vs step host list": (
        SRUN_E, {"SLURM_STEP_NODELIST": "localhost,vm"},
        "SLURM_STEP_NODELIST='localhost,vm' lists 2 hosts but SLURM_STEP_NUM_NODES=1"),
    "step localid on its node": (
        SRUN_E, {"SLURM_LOCALID": "2", "SLURM_GTIDS": None},
        "SLURM_LOCALID='2' must be < 2, the tasks of node 0 in SLURM_STEP_TASKS_PER_NODE='2'"),
}


@pytest.mark.parametrize("base, changes, message", SLURM_REFUSALS.values(), ids=SLURM_REFUSALS.keys())
def test_slurm_refusals_name_the_variable(base, changes, message):
    env = {k: v for k, v in {**base, **changes}.items() if v is not None}
    with pytest.raises(UserError) as caught:
        detect(env)
    assert message in str(caught.value) and "\n" not in str(caught.value)


# --- SLURM's own variables are the truth: a layout that disagrees only loses the dry run's labels ---

# Lightning's SLURM test environment, as an srun step: rank 1 at local rank 2 of node 3, where the
# block layout over 5 tasks a node would put rank 17 (-m arbitrary with a hostfile does such things)
LIGHTNING_TEST = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "0001234", "SLURM_PROCID": "1", "SLURM_LOCALID": "2",
                  "SLURM_NODEID": "3", "SLURM_NTASKS": "20", "SLURM_NNODES": "4", "SLURM_TASKS_PER_NODE": "5(x4)",
                  "SLURM_JOB_NODELIST": "1.1.1.1,1.1.1.2,1.1.1.3,1.1.1.4", "SLURM_JOB_NAME": "JOB"}
SLURM_DISAGREEMENTS = {
    "block layout vs procid": (
        LIGHTNING_TEST, {}, "the layout inferred from SLURM_DISTRIBUTION unset: block over "
                            "SLURM_TASKS_PER_NODE='5(x4)' (this node's ranks by it: 15,16,17,18,19) puts rank 17 "
                            "at local rank 2"),
    "gtids disagree with procid": (
        CYCLIC_NODE0, {"SLURM_GTIDS": "0,1,3,4"},
        "SLURM_GTIDS='0,1,3,4' (this node's ranks by it: 0,1,3,4) puts rank 1 at local rank 1"),
    "gtids too short": (
        CYCLIC_NODE0, {"SLURM_GTIDS": "0,2"}, "SLURM_GTIDS='0,2' (this node's ranks by it: 0,2) lists 2 tasks "
                                              "for this node, which has 4"),
    "gtids beyond the step": (
        CYCLIC_NODE0, {"SLURM_GTIDS": "0,2,3,9"}, "SLURM_GTIDS='0,2,3,9' (this node's ranks by it: 0,2,3,9) "
                                                   "does not list distinct ranks below 5"),
    "gtids not a list": (CYCLIC_NODE0, {"SLURM_GTIDS": "0,,2"}, "SLURM_GTIDS='0,,2' must be the comma-separated"),
    "arbitrary layout, no gtids": (
        CYCLIC_NODE0, {"SLURM_GTIDS": None, "SLURM_DISTRIBUTION": "arbitrary"},
        "SLURM_GTIDS is not set, and SLURM_DISTRIBUTION='arbitrary' does not say"),
    "plane without its size": (
        PLANE2_NODE0, {"SLURM_GTIDS": None, "SLURM_DIST_PLANESIZE": None}, "SLURM_DIST_PLANESIZE is not set"),
}


@pytest.mark.parametrize("base, changes, message", SLURM_DISAGREEMENTS.values(), ids=SLURM_DISAGREEMENTS.keys())
def test_slurms_own_variables_win_over_a_layout_that_disagrees_with_one_warning(base, changes, message, caplog):
    env = {k: v for k, v in {**base, **changes}.items() if v is not None}
    with caplog.at_level("WARNING", logger="expgpu"):
        got = detect(env)
    rank, local, node = (int(env[k]) for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"))
    assert (got.rank, got.local_rank, got.node_rank) == (rank, local, node)
    assert got.ranks_on_node == tuple(rank if i == local else None for i in range(got.local_world_size))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and message in warnings[0] and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"SLURM_PROCID={rank} SLURM_LOCALID={local} SLURM_NODEID={node} used as they are")


def test_a_node_whose_ranks_disagree_with_the_layout_runs_and_its_dry_run_labels_the_rest_unknown(tmp_path):
    env = {**LIGHTNING_TEST, "SLURM_LOCALID": "0"}   # local rank 0 writes the node's plan
    run = expgpu(["dry_run=true", "gpu_map.share=true", "inventory.simulate=[{name:A100,memory_mb:40960}]"],
                 tmp_path / "run", env=clean_env(**env), timeout=60)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("gpu_map=sequential"):].splitlines()[2:7]
    assert [(line.split()[0], line.split()[2]) for line in table] == [("1", "0"), ("?", "1"), ("?", "2"),
                                                                      ("?", "3"), ("?", "4")], run.stdout
    assert "puts rank 15 at local rank 0" in run.output


# --- torchrun with different workers per node, and env:// launches without a rendezvous -----------

def test_torchrun_2_plus_1_workers():
    # torch gives each agent a contiguous block of ranks; node 1's single worker is rank 2, not 1.
    node0, node1 = detect(TORCHRUN_2_PLUS_1_NODE0), detect(TORCHRUN_2_PLUS_1_NODE1)
    assert node0 == RankInfo(1, 1, 3, 2, 0, "127.0.0.1", 29731, "torchrun", 2, (0, 1))
    assert node1 == RankInfo(2, 0, 3, 1, 1, "127.0.0.1", 29731, "torchrun", 2, (2,))


def test_torchrun_virtual_local_rank_is_not_refused():
    # torchrun --virtual-local-rank: every worker gets LOCAL_RANK=0 (and its own GPU as device 0).
    # Its node's other ranks cannot be known; the run must still resolve.
    env = {**TORCHRUN_2_PLUS_1_NODE0, "LOCAL_RANK": "0", "RANK": "2", "WORLD_SIZE": "3"}
    got = detect(env)
    assert (got.rank, got.local_rank, got.ranks_on_node) == (2, 0, ())


ENV_REFUSALS = {
    # the case: a world of 2 that would run as a world of one
    "RANK=1 WORLD_SIZE=2, no MASTER_ADDR": (
        {"RANK": "1", "WORLD_SIZE": "2"}, "environment variable MASTER_ADDR is not set, and WORLD_SIZE=2 needs"),
    "WORLD_SIZE=4 alone": ({"WORLD_SIZE": "4", "MASTER_ADDR": "h"}, "environment variable RANK is not set"),
    "torchrun without MASTER_ADDR": (
        {k: v for k, v in TORCHRUN_2_PLUS_1_NODE1.items() if k != "MASTER_ADDR"},
        "MASTER_ADDR is not set, and WORLD_SIZE=3"),
    "RANK beyond a world of one": ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK='1' must be < WORLD_SIZE=1"),
}


@pytest.mark.parametrize("env, message", ENV_REFUSALS.values(), ids=ENV_REFUSALS.keys())
def test_a_world_without_a_rendezvous_is_refused(env, message):
    with pytest.raises(UserError) as caught:
        detect(env)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_world_of_one_needs_no_address():
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}) == RankInfo(0, 0, 1, 1, 0, "127.0.0.1", 29500, "torchrun", 1)


def test_cli_refuses_a_world_without_master_addr_in_one_line(tmp_path):
    run = expgpu(["task=a"], tmp_path / "run", env=clean_env(RANK="1", WORLD_SIZE="2"), timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("expgpu: error:")]
    assert len(errors) == 1 and "MASTER_ADDR is not set" in errors[0], run.stderr
    assert not (tmp_path / "run" / "result.json").exists()


# --- MASTER_PORT a SLURM job derives: below Linux's ephemeral range ------------------------------

def test_derived_port_is_never_in_linuxs_default_ephemeral_range():
    # 15000 + job id % 20000 put about 11 % of job ids into 32768-60999, where an outgoing connection
    # can hold the port; e.g. job 19999 got 34999.
    ports = {slurm.default_port({"SLURM_JOB_ID": str(job)}, 2) for job in range(100_000, 100_000 + 17768)}
    assert min(ports) == 15000 and max(ports) == 32767
    assert slurm.default_port({"SLURM_JOB_ID": "19999"}, 2) == 15000 + 19999 - 17768


def test_a_node_whose_ephemeral_range_covers_the_port_is_refused(linux_default_ports):
    linux_default_ports.write_text("15000 65000\n")   # a widened ip_local_port_range
    with pytest.raises(UserError) as caught:
        detect(SRUN_E)
    assert str(caught.value).startswith("MASTER_PORT is not set, and the port derived from SLURM_JOB_ID=1 "
                                        "(15001) is in this node's ephemeral range 15000-65000")
    assert detect({**SRUN_E, "MASTER_PORT": "12000"}).master_port == 12000   # the user's port is kept
    one_task = {**SRUN_E, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_GTIDS": "0",
                "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert detect(one_task).world_size == 1   # no process group, no port to guard


def test_an_unreadable_ephemeral_range_means_linuxs_default(linux_default_ports):
    linux_default_ports.unlink()
    assert slurm.ephemeral_ports(linux_default_ports) == (32768, 60999)
    assert detect(SRUN_E).master_port == 15001
