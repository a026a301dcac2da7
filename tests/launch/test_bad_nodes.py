"""A bad node left out on SLURM (launch.exclude_bad_nodes; expgpu.launch.bad_nodes): which node a failure was on,
how it is left out (the next srun step, a requeue, or not at all), and what result.json says. The real runs on
the 2-node local cluster are tests/slurm/test_slurm_bad_node.py."""

from __future__ import annotations

import json
import time

import pytest

from conftest import expgpu
from expgpu import results, rundir
from expgpu.errors import EXIT_HUNG
from expgpu.launch import bad_nodes, restarts

CRASH = "RuntimeError: injected crash on rank 1 at step 13"
HANG = "rank 1 has not finished step 6 for 6 s (limit 5 s); rank 1 at hang_probe.py:30 in hangs"


def _node(monkeypatch, tmp_path, rank: int, node: str, attempt: int = 1) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", node)
    monkeypatch.setenv("EXPGPU_ATTEMPT", str(attempt))
    results.write_rank_node(tmp_path, rank)


def test_a_failure_is_one_nodes_when_its_ranks_at_fault_all_ran_there(tmp_path, monkeypatch):
    for rank, node in ((0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")):
        _node(monkeypatch, tmp_path, rank, node)
    hung = {"attempt": 1, "kind": "hung", "reason": HANG, "ranks": [1]}
    assert bad_nodes.node_of(tmp_path, hung, None) == "n1"
    assert bad_nodes.node_of(tmp_path, {**hung, "ranks": [0, 1]}, None) == "n1"
    assert bad_nodes.node_of(tmp_path, {**hung, "ranks": [1, 2]}, None) is None   # two nodes: not one node's
    assert bad_nodes.node_of(tmp_path, {**hung, "ranks": [7]}, None) is None      # a rank that said nothing
    assert bad_nodes.node_of(tmp_path, {**hung, "ranks": None}, None) is None
    assert bad_nodes.node_of(tmp_path, {**hung, "attempt": 2}, None) is None      # an earlier attempt's records
    # a crash before its rank said where it runs: the failure record's node
    crash = {"attempt": 1, "kind": "crash", "reason": CRASH, "ranks": [5]}
    assert bad_nodes.node_of(tmp_path, crash, {"rank": 5, "node": "n3", "message": CRASH}) == "n3"
    assert bad_nodes.node_of(tmp_path, crash, {"rank": 4, "node": "n3", "message": CRASH}) is None


def test_the_records_name_slurms_node_not_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu07")
    results.write_failure(tmp_path, 1, CRASH, step=13)
    results.write_job_failure(tmp_path, CRASH, rank=1, step=13)
    assert json.loads(rundir.failure_file(tmp_path, 1).read_text())["node"] == "gpu07"
    assert results.read_job_failure(tmp_path)["node"] == "gpu07"
    monkeypatch.delenv("SLURMD_NODENAME")
    results.write_rank_node(tmp_path, 3)   # outside SLURM: no record
    assert results.read_rank_node(tmp_path, 3) is None


def _alloc(**kw) -> bad_nodes.Allocation:
    return bad_nodes.Allocation(**{"job": "42", "nodes": ("n1", "n2", "n3"), "step_nodes": 2,
                                   "partition": "gpu", **kw})


def test_a_node_is_left_out_by_the_next_step_while_the_allocation_has_another_else_by_a_requeue():
    never = pytest.fail   # the allocation had room: SLURM is not asked

    step = bad_nodes.choose("n1", _alloc(), lambda job: never("asked"), lambda part: never("asked"))
    assert (step.how, step.exclude) == ("step", ("n1",))
    assert step.text == "node n1 left out: the next srun step runs on 2 of the allocation's other nodes (n2, n3)"
    # n1 out already: n2 too leaves one node for a 2-node step; the job is requeued without both
    requeue = bad_nodes.choose("n2", _alloc(left_out=("n1",)), lambda job: ["n9"], lambda part: [f"n{i}" for i in
                                                                                                  range(1, 10)])
    assert (requeue.how, requeue.exclude) == ("requeue", ("n9", "n1", "n2"))
    assert requeue.text == ("node n2 left out: the allocation has no other node for its 2-node step; requeueing "
                            "job 42 with ExcNodeList=n9,n1,n2 (partition gpu has 6 other usable node(s))")
    # the partition has no 3 other usable nodes: not left out
    none = bad_nodes.choose("n2", _alloc(left_out=("n1",)), lambda job: [], lambda part: ["n1", "n2", "n3", "n4"])
    assert none.how == "none" and none.text == (
        "node n2 not left out: the allocation has no other node for its 2-node step, and partition gpu has 2 usable "
        "node(s) outside n1,n2, fewer than the job's 3; restarting on the same nodes")
    # a step of srun's default shape (no --ntasks-per-node) uses every node: only a requeue leaves one out
    plain = bad_nodes.choose("n1", _alloc(step_nodes=None), lambda job: [], lambda part: ["n1", "n2", "n3", "n4"])
    assert plain.how == "requeue" and "its srun step uses every node of the allocation" in plain.text
    assert bad_nodes.choose("n1", _alloc(step_nodes=None), lambda job: [], lambda part: None).how == "none"


def test_sinfo_states_a_job_cannot_start_on_are_not_usable(monkeypatch):
    class Done:
        returncode = 0
        stdout = "n1 idle\nn2 alloc\nn3 down*\nn4 drain\nn5 mix\nn6 idle*\nn7 idle~\nn2 alloc\nn8 drng\n"

    monkeypatch.setattr(bad_nodes, "_run", lambda cmd: Done())
    assert bad_nodes.usable_nodes("gpu") == ["n1", "n2", "n5", "n7"]


def _step_dir(tmp_path, **launch):
    """A run dir as a failed srun step of scripts/expgpu.sbatch leaves it: Hydra's config, a checkpoint."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    keys = {"max_restarts": 1, "on_hang": "restart", **launch}
    (run_dir / ".hydra" / "config.yaml").write_text(
        "task:\n  max_steps: 30\nlaunch:\n" + "".join(f"  {k}: {v}\n" for k, v in keys.items()))
    (run_dir / "checkpoint.pt").write_bytes(b"")
    return run_dir


def _hung(run_dir, monkeypatch, node="n1"):
    for rank in (0, 1):
        _node(monkeypatch, run_dir, rank, node)
    rundir.hang_dir(run_dir).mkdir()
    rundir.hang_verdict(run_dir).write_text(json.dumps({"line": HANG, "culprits": [1],
                                                        "ranks": {"0": {"step": 6}, "1": {"step": 5}}}))


def test_after_a_hang_on_one_node_the_next_step_leaves_it_out_and_result_json_says_so(tmp_path, monkeypatch,
                                                                                       capsys):
    run_dir, started = _step_dir(tmp_path), time.time()
    _hung(run_dir, monkeypatch)
    alloc = bad_nodes.Allocation("42", ("n1", "n2"), 1)
    assert restarts.after_step(run_dir, 1, EXIT_HUNG, started, alloc) == 0
    out = capsys.readouterr()
    assert out.out == "n1\n"   # the loop's next `srun --exclude`
    assert out.err.splitlines()[1] == ("expgpu: node n1 left out: the next srun step runs on 1 of the allocation's "
                                       "other nodes (n2)")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("EXPGPU_ATTEMPT", "2")
    doc = results.write_result(run_dir, {k: None for k in results.EVERY_RUN + results.FUNCTION_KEYS})
    (row,) = doc["excluded_nodes"]
    assert {k: row[k] for k in ("node", "reason", "attempt", "ranks", "how", "job", "restart")} == {
        "node": "n1", "reason": f"hung: {HANG}", "attempt": 1, "ranks": [1], "how": "step", "job": "42", "restart": 0}
    monkeypatch.setenv("SLURM_JOB_ID", "43")   # another job in the same run dir: not its nodes
    assert results.write_result(run_dir, {k: None for k in results.EVERY_RUN + results.FUNCTION_KEYS})[
        "excluded_nodes"] == []


def test_exclude_bad_nodes_false_restarts_on_the_same_nodes(tmp_path, monkeypatch, capsys):
    run_dir, started = _step_dir(tmp_path, exclude_bad_nodes="false"), time.time()
    _hung(run_dir, monkeypatch)
    assert restarts.after_step(run_dir, 1, EXIT_HUNG, started, bad_nodes.Allocation("42", ("n1", "n2"), 1, ("n3",))) \
        == 0
    out = capsys.readouterr()
    assert out.out == "n3\n" and "left out" not in out.err   # what the loop left out before stays out
    assert not rundir.excluded_nodes_file(run_dir).exists()


def test_a_crash_on_the_allocations_only_node_requeues_the_job_without_it(tmp_path, monkeypatch, capsys):
    run_dir, started = _step_dir(tmp_path), time.time()
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    results.write_job_failure(run_dir, CRASH, rank=1, step=13)
    asked = []
    monkeypatch.setattr(bad_nodes, "excluded_of", lambda job: [])
    monkeypatch.setattr(bad_nodes, "usable_nodes", lambda part: ["n1", "n2"])
    monkeypatch.setattr(bad_nodes, "requeue_without", lambda job, nodes: asked.append((job, nodes)) or (False, None))
    alloc = bad_nodes.Allocation("42", ("n1",), 1, partition="debug", restart=0)
    assert restarts.after_step(run_dir, 1, 143, started, alloc) == 1   # requeued: this run of the job ends
    assert asked == [("42", ("n1",))]
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines()[-1] == (
        "expgpu: node n1 left out: the allocation has no other node for its 1-node step; requeueing job 42 with "
        "ExcNodeList=n1 (partition debug has 1 other usable node(s))")
    # the requeued job's run goes on counting attempts; a later requeue (a stop) starts again at 1
    assert bad_nodes.first_attempt(run_dir, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}) == 2
    assert bad_nodes.first_attempt(run_dir, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}) == 1
    assert bad_nodes.first_attempt(run_dir, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}) == 1
    # not requeueable: the same nodes
    monkeypatch.setattr(bad_nodes, "requeue_without", lambda job, nodes: (True, "cannot requeue SLURM job 42: no"))
    assert restarts.after_step(run_dir, 1, 143, started, alloc) == 0
    out = capsys.readouterr()
    assert out.out == "\n" and out.err.splitlines()[-1] == (
        "expgpu: node n1 not left out: cannot requeue SLURM job 42: no; restarting on the same nodes")


def test_the_restart_loops_command_line(tmp_path, capsys):
    assert restarts.main(["r", "1", "1", "0", "x", ""]) == 2   # STEP_NODES not a count
    assert "usage: python -m expgpu.launch.restarts" in capsys.readouterr().err
    assert restarts.main(["--first-attempt", str(tmp_path)]) == 0 and capsys.readouterr().out == "1\n"


@pytest.mark.slow
def test_exclude_bad_nodes_takes_true_or_false_in_one_line(tmp_path):
    run = expgpu(["task=a", "launch.exclude_bad_nodes=maybe"], tmp_path / "run")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert [line for line in run.stderr.splitlines() if line.startswith("expgpu:")] == [
        "expgpu: error: launch.exclude_bad_nodes: Value 'maybe' is not a valid bool (type str)"]
