"""A bad node left out (launch.exclude_bad_nodes, expgpu.launch.bad_nodes) on the real 2-node local SLURM cluster
(two slurmd on this machine: two node names, one host, so a rank's node is SLURM's name of it, not the host's).

- a hang on one node's ranks (a 1-node step with a spare node in a 2-node allocation, EXPGPU_SPARE_NODES=1): the
  next srun step of the same allocation runs on the other node, and finishes;
- a crash on a 1-node job's node: the job is requeued with the node in its ExcNodeList, runs on the other node as
  attempt 2, and finishes;
- a hang on one node of a 2-node step: neither the allocation nor the partition has another node, so the step
  starts again on the same nodes, and a line says why;
- launch.exclude_bad_nodes=maybe: one line, exit 2.
"""

from __future__ import annotations

import json
import re

import pytest
from slurm_cluster import restarts, slurm_cluster_2n  # noqa: F401

from conftest import HELPERS, REPO, TESTS, pythonpath

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = ["--cpus-per-task=1", "--gpus-per-node=0", str(REPO / "scripts" / "expgpu.sbatch")]
# Rank 1 stops in step 18 (at=17), 7 steps of 0.3 s after the checkpoint at step 10 (not in an attempt's first
# step, which the watchdog gives launch.hang.slow_phase_s); probe_hangs_once hangs in the first attempt only
HANGS_ONCE = ["--config-dir", str(TESTS / "conf"), "task=probe_hangs_once", "task.at=17", "task.step_s=0.3",
              "task.max_steps=24", "launch.on_hang=restart", "launch.max_restarts=1", "launch.hang.timeout_s=5",
              "checkpoint.every_steps=10", "backend.timeout_s=60", "logger=none"]
CRASHES_ONCE = ["task=a", "task.max_steps=30", "task.log_every=1", "checkpoint.every_steps=5", "backend.timeout_s=60",
                "faults.crash_rank=1", "faults.crash_step=13", "faults.crash_attempts=1", "launch.max_restarts=1",
                "logger=none"]
# srun names the node whose tasks failed
FAILED_ON = re.compile(r"^srun: error: (\S+): tasks? [\d,-]+: Exited with exit code (\d+)$", re.M)


def _fields(cluster, job: str) -> dict:
    out = cluster.run(["scontrol", "-o", "show", "job", job]).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def _run(cluster, tmp_path, sbatch: list[str], args: list[str], timeout: float = 200, **env) -> tuple[str, str]:
    job = cluster.sbatch([*sbatch, *SBATCH, *args], cwd=tmp_path,
                         env={**cluster.env, "PYTHONPATH": pythonpath(HELPERS), **env})
    out = tmp_path / f"slurm-{job}.out"
    state = cluster.wait_job(job, timeout=timeout)
    return job, f"{state}\n{out.read_text() if out.exists() else ''}"


def _nodes_of_ranks(run_dir) -> set[str]:
    """The nodes the last attempt's ranks ran on (their RUN_DIR/.expgpu/rank<N>.node.json)."""
    return {json.loads(p.read_text())["node"] for p in (run_dir / ".expgpu").glob("rank*.node.json")}


@pytest.mark.timeout(300)
def test_a_hang_on_one_nodes_ranks_restarts_on_the_spare_node_of_the_allocation(slurm_cluster_2n, tmp_path):
    cluster = slurm_cluster_2n
    job, log = _run(cluster, tmp_path, ["-N", "2", "--ntasks-per-node=2"], HANGS_ONCE, EXPGPU_SPARE_NODES="1")
    assert log.startswith("COMPLETED\n"), log[-4000:]
    assert restarts(cluster, job) == 0   # the same allocation
    (bad, code), = set(FAILED_ON.findall(log))   # the hung step's ranks, on one node, exited 124
    assert code == "124"
    (good,) = set(cluster.nodes) - {bad}
    assert f"expgpu: node {bad} left out: the next srun step runs on 1 of the allocation's other nodes ({good})" \
        in log.splitlines(), log[-4000:]
    run_dir = tmp_path / "outputs" / "slurm" / job
    assert _nodes_of_ranks(run_dir) == {good}
    res = json.loads((run_dir / "result.json").read_text())
    assert (res["status"], res["world_size"], res["resumed_from_step"], res["steps"]) == ("finished", 2, 10, 24)
    assert [(a["attempt"], a["kind"], a["ranks"]) for a in res["attempts"]] == [(1, "hung", [1]), (2, "finished", None)]
    (left,) = res["excluded_nodes"]
    assert (left["node"], left["attempt"], left["ranks"], left["how"], left["job"]) == (bad, 1, [1], "step", job)
    assert left["reason"] == f"hung: {res['attempts'][0]['reason']}"


@pytest.mark.timeout(300)
def test_a_crash_on_a_one_node_jobs_node_requeues_the_job_without_it(slurm_cluster_2n, tmp_path):
    cluster = slurm_cluster_2n
    job, log = _run(cluster, tmp_path, ["-N", "1", "--ntasks-per-node=2"], CRASHES_ONCE)
    assert log.startswith("COMPLETED\n"), log[-4000:]
    fields = _fields(cluster, job)
    bad = fields["ExcNodeList"]
    (good,) = set(cluster.nodes) - {bad}
    assert (restarts(cluster, job), fields["NodeList"]) == (1, good)
    assert (f"expgpu: node {bad} left out: the allocation has no other node for its 1-node step; requeueing job "
            f"{job} with ExcNodeList={bad} (partition {cluster.partition} has 1 other usable node(s))"
            in log.splitlines()), log[-4000:]
    assert {node for node, _ in FAILED_ON.findall(log)} == {bad}
    run_dir = tmp_path / "outputs" / "slurm" / job
    assert _nodes_of_ranks(run_dir) == {good}
    res = json.loads((run_dir / "result.json").read_text())
    assert (res["status"], res["world_size"], res["resumed_from_step"], res["steps"]) == ("finished", 2, 10, 30)
    # the requeued job's run is attempt 2: faults.crash_attempts=1 crashed only the first
    assert [(a["attempt"], a["kind"], a["ranks"], a["step"]) for a in res["attempts"]] == \
        [(1, "crash", [1], 13), (2, "finished", None, 30)]
    (left,) = res["excluded_nodes"]
    assert (left["node"], left["attempt"], left["how"], left["restart"]) == (bad, 1, "requeue", 0)
    assert left["reason"].startswith("rank 1 failed: RuntimeError: injected crash")


@pytest.mark.timeout(300)
def test_a_rank_killed_outright_is_named_by_its_peers_in_one_line_and_no_node_is_blamed(slurm_cluster_2n, tmp_path):
    """Rank 1 (the second node's) SIGKILLed: it records nothing, and rank 0's collective fails on the first node.
    Rank 0 says one line, not a traceback; the first failure record is its echo, marked so: the restart's
    reason says a rank was killed outright, and rank 0's node is not left out for it."""
    cluster = slurm_cluster_2n
    job, log = _run(cluster, tmp_path, ["-N", "2", "--ntasks-per-node=1"], [*CRASHES_ONCE, "faults.kind=kill"])
    assert log.startswith("COMPLETED\n"), log[-4000:]
    assert ("expgpu: rank 0: stopping: its process group lost a peer (" in log and "and no rank recorded an error of "
            "its own: a rank was killed outright" in log), log[-4000:]
    assert "Traceback" not in log and not re.search(r"^expgpu: node ", log, re.M), log[-4000:]
    res = json.loads((tmp_path / "outputs" / "slurm" / job / "result.json").read_text())
    assert [(a["attempt"], a["kind"], a["ranks"]) for a in res["attempts"]] == \
        [(1, "crash", None), (2, "finished", None)]
    assert res["attempts"][0]["reason"].startswith("a rank was killed outright (no rank recorded an error of its own; "
                                                   "rank 0's collective lost its peer: "), res["attempts"][0]
    assert not res["excluded_nodes"] and res["status"] == "finished"


@pytest.mark.timeout(300)
def test_a_hang_on_one_node_of_a_two_node_step_restarts_on_the_same_nodes_when_no_node_is_left(slurm_cluster_2n,
                                                                                               tmp_path):
    cluster = slurm_cluster_2n
    job, log = _run(cluster, tmp_path, ["-N", "2", "--ntasks-per-node=1"], HANGS_ONCE)
    assert log.startswith("COMPLETED\n"), log[-4000:]
    assert restarts(cluster, job) == 0
    said = [line for line in log.splitlines() if "not left out" in line]
    assert len(said) == 1 and re.fullmatch(
        r"expgpu: node (\S+) not left out: the allocation has no other node for its 2-node step, and partition "
        rf"{cluster.partition} has 1 usable node\(s\) outside \1, fewer than the job's 2; restarting on the same nodes",
        said[0]), log[-4000:]
    run_dir = tmp_path / "outputs" / "slurm" / job
    assert _nodes_of_ranks(run_dir) == set(cluster.nodes)
    res = json.loads((run_dir / "result.json").read_text())
    assert (res["status"], res["excluded_nodes"]) == ("finished", [])
    assert [(a["attempt"], a["kind"], a["ranks"]) for a in res["attempts"]] == [(1, "hung", [1]), (2, "finished", None)]


@pytest.mark.timeout(120)
def test_exclude_bad_nodes_maybe_is_one_line_and_exit_2(slurm_cluster_2n, tmp_path):
    job, log = _run(slurm_cluster_2n, tmp_path, ["-N", "1", "--ntasks-per-node=1"],
                    ["task=a", "launch.exclude_bad_nodes=maybe"], timeout=90)
    assert log.startswith("FAILED\n") and _fields(slurm_cluster_2n, job)["ExitCode"] == "2:0", log
    assert [line for line in log.splitlines() if line.startswith("expgpu")][1:] == [
        "expgpu: error: launch.exclude_bad_nodes: Value 'maybe' is not a valid bool (type str)"], log
