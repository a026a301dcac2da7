"""The allocation's model, pure (expgpu.pool.allocation, expgpu.pool.steps, expgpu.pool.node_servers): each node's
GPUs from scontrol, where a job's GPUs (or CPU slots) fit, what a step asks srun for, and what a warm fork is given.
The real sweeps in a real allocation: test_gpu_pool_allocation.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from expgpu.pool.allocation import Allocation, Slot, check_job, fit, node_gpus, on_cpu_slots
from expgpu.pool.node_servers import rank_env, share
from expgpu.pool.steps import master_port, srun_command, step_cpus, step_env, step_mem_mb
from expgpu.slurm.cluster import gres_gpus

SCONTROL = """JobId=38 JobName=s.sh
   NumNodes=2 NumCPUs=16 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   JOB_GRES=gpu:8
     Nodes=gpu-[01-02] CPU_IDs=0-7 Mem=0 GRES=gpu:a100:4(IDX:0-3)
     Nodes=gpu-07 CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:1,3)
   TresPerNode=gres:gpu:4
"""


def test_each_nodes_gpus_are_read_from_scontrol():
    assert node_gpus(SCONTROL) == {"gpu-01": (0, 1, 2, 3), "gpu-02": (0, 1, 2, 3), "gpu-07": (1, 3)}


def _alloc(**gpus: int) -> Allocation:
    return Allocation("7", tuple(gpus), {n: tuple(range(k)) for n, k in gpus.items()}, {n: 8 for n in gpus}, None)


def test_a_jobs_gpus_come_from_as_many_nodes_as_it_asks_the_fullest_fitting_first():
    free = [Slot("a", 0), Slot("b", 0), Slot("b", 1), Slot("b", 2), Slot("c", 0), Slot("c", 1)]
    assert fit(free, 1, 1) == (Slot("a", 0),)            # the node with the fewest free GPUs that fit
    assert fit(free, 2, 1) == (Slot("c", 0), Slot("c", 1))
    assert fit(free, 4, 2) == (Slot("c", 0), Slot("c", 1), Slot("b", 0), Slot("b", 1))
    assert fit(free, 4, 1) is None                       # never 4 from two nodes for a 1-node job
    assert fit(free, 6, 3) is None


@pytest.mark.parametrize("need, nodes, message", [
    (6, 1, "job #0 (x=1) needs 6 GPUs on each of 1 node(s), but the allocation has at most 4 GPU(s) per node "
           "(SLURM job 7: 2 node(s) (a,b) x 4 GPU(s)); allowed: at most 4 per node (GPUS_KEY, over launch.nodes "
           "nodes)"),
    (12, 2, "needs 6 GPUs on each of 2 node(s), but the allocation has at most 4 GPU(s) per node"),
    (2, 3, "asks for launch.nodes=3, but the allocation has 2 node(s); allowed: 1..2"),
    (3, 2, "needs 3 GPUs, not a multiple of launch.nodes=2"),
])
def test_a_job_that_can_never_fit_is_one_line(need, nodes, message):
    from expgpu.errors import UserError

    with pytest.raises(UserError, match="^") as got:
        check_job("job #0 (x=1)", need, nodes, _alloc(a=4, b=4), "launch.nodes", "GPUS_KEY")
    assert message in str(got.value)
    check_job("job #0 (x=1)", 8, 2, _alloc(a=4, b=4), "launch.nodes", "GPUS_KEY")   # fits: no error


def test_a_warm_jobs_gpus_are_its_servers_entries_for_them_and_its_cpus_their_share():
    info = {"gpus": ["0", "1", "2", "3"], "step_gpus": ["4", "5", "6", "7"], "cpus": list(range(16))}
    assert share([5, 7], [4, 5, 6, 7], info) == ("1,3", "5,7", [4, 5, 6, 7, 12, 13, 14, 15])
    # what SLURM shows a step when it does not constrain devices: the node's own numbers
    plain = {"gpus": ["4", "5", "6", "7"], "step_gpus": [], "cpus": [0, 1]}
    assert share([6], [4, 5, 6, 7], plain) == ("6", "6", [0, 1])
    env = rank_env(1, ["gpu-01", "gpu-02"], "3")
    assert (env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"], env["SLURM_STEP_NODELIST"], env["SLURM_STEP_ID"]) \
        == ("1", "2", "gpu-[01-02]", "3")
    from expgpu.ranks import slurm

    assert slurm.in_srun_step(env) and slurm.hosts(env) == ("SLURM_STEP_NODELIST", ["gpu-01", "gpu-02"])


def test_a_steps_command_asks_for_its_nodes_gpus_and_share_of_cpus_and_memory_and_nothing_inherited():
    alloc = Allocation("7", ("a", "b"), {"a": (0, 1, 2, 3), "b": (0, 1, 2, 3)}, {"a": 8, "b": 16}, 4000)
    slots = [Slot("a", 0), Slot("a", 1), Slot("b", 2), Slot("b", 3)]
    assert (step_cpus(alloc, slots), step_mem_mb(alloc, slots)) == (4, 2000)   # the least of its nodes' shares
    assert step_cpus(alloc, [Slot("a", 0)]) == 2
    cmd = srun_command(slots, 4, 2000, "/x/job.pkl")
    assert cmd[:10] == ["srun", "--exact", "--kill-on-bad-exit=1", "--nodes=2", "--nodelist=a,b", "--ntasks=2",
                        "--ntasks-per-node=1", "--gres=gpu:2", "--cpus-per-task=4", "--mem=2000M"]
    assert cmd[-2:] == ["expgpu.pool.step_process", "/x/job.pkl"]
    # the allocation's shape, which srun reads from its environment, does not reach the step
    env = step_env({"SLURM_NTASKS_PER_NODE": "4", "SLURM_MEM_PER_NODE": "4000", "SLURM_JOB_ID": "7", "PATH": "/bin",
                    "EXPGPU_POOL_PARENT": "1"}, {"MASTER_PORT": "1"})
    assert env == {"SLURM_JOB_ID": "7", "PATH": "/bin", "MASTER_PORT": "1"}
    assert len({master_port("7", n) for n in range(100)} | {master_port("8", n) for n in range(100)}) == 200


def test_an_allocation_without_gpus_is_cpu_slots_each_with_its_share_of_the_node_and_no_gpu():
    plain = Allocation("9", ("a", "b"), {"a": (), "b": ()}, {"a": 8, "b": 4}, 6000)
    alloc = on_cpu_slots(plain, 2)
    assert alloc.describe() == "SLURM job 9: 2 node(s) (a,b) x 2 CPU slot(s)"
    assert alloc.slots() == [Slot("a", 0, True), Slot("a", 1, True), Slot("b", 0, True), Slot("b", 1, True)]
    assert (step_cpus(alloc, [Slot("a", 1, True)]), step_mem_mb(alloc, [Slot("a", 1, True)])) == (4, 3000)
    assert step_cpus(alloc, [Slot("a", 0, True), Slot("b", 0, True)]) == 2   # the least of its nodes' shares
    cmd = srun_command([Slot("b", 1, True)], 2, None, "/x/job.pkl")
    assert cmd[:8] == ["srun", "--exact", "--kill-on-bad-exit=1", "--nodes=1", "--nodelist=b", "--ntasks=1",
                       "--ntasks-per-node=1", "--cpus-per-task=2"] and not any("gres" in c for c in cmd)
    # forked by a node's warm process: no GPU at all, and its slot's half of the CPUs the server was given
    assert share([1], [0, 1], {"gpus": [], "step_gpus": [], "cpus": [0, 1, 2, 3]}, cpu=True) == ("", "", [2, 3])
    from expgpu.pool.jobs import Job

    job = Job(num=3, overrides=[], dir=Path("/x"), config=None, need=1)
    job.gpus = [Slot("b", 1, True)]
    assert job.where == "b: CPU slot 1"


def test_shared_gpus_of_an_allocation_fill_every_gpu_before_a_second_share_and_a_job_never_takes_two_of_one():
    from expgpu.pool.sharing import SlotShare, shares

    slots = shares([Slot("a", 0), Slot("a", 1), Slot("b", 0)], 2)
    assert [(s.node, s.index, s.share) for s in slots] == [("a", 0, 0), ("a", 1, 0), ("b", 0, 0),
                                                           ("a", 0, 1), ("a", 1, 1), ("b", 0, 1)]
    free = list(slots)
    one = fit(free, 1, 1)
    assert one == (SlotShare("b", 0, share=0, of=2),)   # an idle GPU, on the fullest node that fits
    free = [s for s in free if s not in one]
    two = fit(free, 2, 1)
    assert [(s.node, s.index, s.share) for s in two] == [("a", 0, 0), ("a", 1, 0)]   # two GPUs, not one twice
    free = [s for s in free if s not in two]
    assert fit(free, 1, 1) == (SlotShare("b", 0, share=1, of=2),)   # every GPU busy: a second share, packed
    assert fit(free, 2, 1) == (SlotShare("a", 0, share=1, of=2), SlotShare("a", 1, share=1, of=2))
    assert fit(free, 2, 2) == (SlotShare("b", 0, share=1, of=2), SlotShare("a", 0, share=1, of=2))
    assert fit([SlotShare("a", 0, share=0, of=2), SlotShare("a", 0, share=1, of=2)], 2, 1) is None
    from expgpu.pool.jobs import Job

    job = Job(num=3, overrides=[], dir=Path("/x"), config=None, need=1)
    job.gpus = [SlotShare("a", 1, share=1, of=2)]
    assert job.where == "a: 1 GPU (share 2 of 2)"


def test_a_share_of_a_gpu_forked_by_its_nodes_warm_process_gets_its_part_of_that_gpus_cpus():
    info = {"gpus": ["0", "1"], "step_gpus": ["0", "1"], "cpus": list(range(8))}   # 4 CPUs per GPU
    assert share([1], [0, 1], info, shares=[0], of=2) == ("1", "1", [4, 5])
    assert share([1], [0, 1], info, shares=[1], of=2) == ("1", "1", [6, 7])
    assert share([0, 1], [0, 1], info, shares=[1, 0], of=2) == ("0,1", "0,1", [2, 3, 4, 5])
    assert share([1], [0, 1], info, shares=[3], of=4) == ("1", "1", [7])
    # fewer CPUs per GPU than shares: each share gets all of its GPU's, and none of the other GPU's
    assert share([1], [0, 1], info, shares=[5], of=8) == ("1", "1", [4, 5, 6, 7])


def test_shared_gpus_become_one_job_each_when_warm_starts_go_off_before_any_job_started(caplog):
    """A node's warm process that ended before it was ready: the jobs are srun steps of their own, which SLURM
    never lets share a GPU, so the pool counts each GPU once from then on, and says so."""
    import types

    from expgpu.pool.sharing import shares
    from expgpu.pool.steps import StepStarter

    class Ended:   # a node's warm process whose srun step ended before it said "ready"
        node, info, gone, proc = "a", None, True, types.SimpleNamespace(poll=lambda: 1)

        def pump(self):
            pass

        def close(self):
            self.closed = True

    pool = StepStarter()
    pool.node_servers, pool.s = {"a": Ended()}, types.SimpleNamespace(jobs_per_gpu=2)
    pool.gpus = shares([Slot("a", 0), Slot("a", 1)], 2)
    pool.board = types.SimpleNamespace(waiting=lambda text: None)
    assert pool._servers_ready() and pool.node_servers is None
    assert pool.gpus == [Slot("a", 0), Slot("a", 1)]
    assert "one on each GPU (hydra.launcher.jobs_per_gpu=2 off)" in caplog.text


@pytest.mark.parametrize("gres, gpus", [("gpu:4", 4), ("gpu:a100:2(S:0-1),gpu:t4:1,nvme:1", 3), ("(null)", 0),
                                        ("nvme:1,gpu:8(S:0)", 8), ("gpu:h100:8(S:0-1)", 8), ("gpus_fake:2", 0)])
def test_a_nodes_gres_in_sinfo_counts_its_gpus_of_every_type(gres, gpus):
    assert gres_gpus(gres) == gpus   # slurm_pool's warning that whole nodes come with their GPUs
