"""Loops in the shapes scripts already have, ported with few lines and resumed exactly: a nested
`for epoch in run.epochs(n): for step, batch in run.steps(loader)` with code of its own around each
epoch, a hidden state each rank carries across steps, the model's own methods through run.wrap,
parameters taken as one config object, and a finished run trained on by its own length key."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from probes import PROBE_ENV, error_line, probe

from conftest import TESTS, finish, start, untimed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.xdist_group("test_run_shapes")]

RNN = ["task=probe_rnnlm", "launch.nproc_per_node=2"]


def _rows(run_dir: Path) -> list[dict]:
    return [untimed(json.loads(line))
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def rnn_reference(tmp_path_factory):
    run = probe(RNN, tmp_path_factory.mktemp("rnnref") / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["steps"] == 32 and run.result["metrics"] == {"wrapped_is_raw": 1, "plain_names": 1}
    return run


def _at(run_dir: Path) -> int:
    try:
        return int((run_dir / "at").read_text() or -1)
    except (OSError, ValueError):
        return -1


def test_an_epoch_loop_stopped_mid_epoch_resumes_exactly_with_each_ranks_carried_state(tmp_path, rnn_reference):
    run_dir = tmp_path / "run"
    # Steps of 0.25 s (a poll after each): the signal during step 10 stops at step 11 or 12, mid-epoch 1.
    at = _stop_mid_epoch_1(RNN, run_dir)
    resumed = probe(RNN, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    res, ref = resumed.result, rnn_reference.result
    assert res["resumed_from_step"] == at and res["steps"] == 32
    # Each rank got its own hidden state back (rank 0's on rank 1 would change its gradients), the
    # epoch-start reset did not clobber the restored one, and the data continued where it stopped.
    assert res["param_checksum"] == ref["param_checksum"] and len(set(res["rank_checksums"])) == 1
    assert _rows(run_dir) == _rows(rnn_reference.run_dir)
    for rank in (0, 1):   # (the step, the batch's index in its epoch of 8), from the stop on
        assert json.loads((run_dir / f"seen{rank}.json").read_text()) == [[s, s % 8] for s in range(at, 32)]


LOCALS = ["task=probe_rnnlm_locals", "launch.nproc_per_node=2"]


def _stop_mid_epoch_1(args: list[str], run_dir: Path) -> int:
    """Start a run of 0.25 s steps, SIGTERM it during step 10, return the step it stopped at."""
    proc = start(["--config-dir", str(TESTS / "conf"), *args], run_dir, env={**PROBE_ENV, "PROBE_STEP_S": "0.25"})
    deadline = time.monotonic() + 90
    while _at(run_dir) < 10 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, run_dir)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    at = stopped.result["steps"]
    assert 10 < at < 16, f"stopped at {at}: not in the middle of epoch 1"
    return at


def test_a_scripts_own_loader_and_loop_variables_kept_by_name_resume_exactly(tmp_path):
    straight = probe(LOCALS, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "run"
    at = _stop_mid_epoch_1(LOCALS, run_dir)
    resumed = probe(LOCALS, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The hidden state and the running sum (keep= of run.steps), the annealed learning rate and the
    # best sum (keep= of run.epochs) came back into the plain variables: every logged value and every
    # parameter as in the run never stopped, on both ranks; the shuffled DataLoader the function
    # built itself was shared out between the ranks and resumed at its place.
    assert resumed.result["param_checksum"] == straight.result["param_checksum"]
    assert resumed.result["metrics"] == straight.result["metrics"]
    assert _rows(run_dir) == _rows(tmp_path / "straight")
    seen = [json.loads((run_dir / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    whole = [json.loads((tmp_path / "straight" / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):   # (step, its index in the epoch of 8, the epoch numbered from 1, the batch)
        assert [row[:3] for row in seen[rank]] == [[s, s % 8, s // 8 + 1] for s in range(at, 32)]
        assert seen[rank] == whole[rank][at:]   # the same batches as the run never stopped
        # the resumed epoch's own code, before its steps, found the annealed lr of the run never stopped
        resumed_starts = json.loads((run_dir / f"starts{rank}.json").read_text())
        assert resumed_starts == json.loads((tmp_path / "straight" / f"starts{rank}.json").read_text())[1:]
    # each rank its own share of every epoch: 8 batches of 4 chunks each, the 64 chunks all seen once
    for epoch in (1, 2, 3, 4):
        chunks = {tuple(chunk) for rank in (0, 1) for row in whole[rank] if row[2] == epoch for chunk in row[3]}
        assert len(chunks) == 64


def test_keep_naming_no_variable_of_the_function_says_which_it_has(tmp_path):
    line = error_line(probe(["task=probe_keeps_unknown"], tmp_path / "run"))
    assert "run.steps: keep names hiden, which keeps_unknown() has no local variable of; it has hidden, run" in line


@pytest.mark.parametrize("nproc", [1, 2])
def test_code_written_for_torchrun_finds_its_rank_in_torchruns_variables(tmp_path, nproc):
    run = probe(["task=probe_torchrun_env", f"launch.nproc_per_node={nproc}"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(nproc):
        seen = json.loads((tmp_path / "run" / f"env{rank}.json").read_text())
        assert seen == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc)}


def test_launch_stdout_rank0_shows_what_rank_0_prints_and_keeps_the_others_in_their_logs(tmp_path):
    every = probe(["task=probe_prints", "launch.nproc_per_node=2"], tmp_path / "every")
    assert "printed by rank 0" in every.stdout and "printed by rank 1" in every.stdout
    once = probe(["task=probe_prints", "launch.nproc_per_node=2", "launch.stdout=rank0"], tmp_path / "once")
    assert once.returncode == 0, once.stderr[-3000:]
    assert "printed by rank 0" in once.stdout and "printed by rank 1" not in once.output
    assert (tmp_path / "once" / "logs" / "rank1.out").read_text() == "printed by rank 1\n"


def test_a_finished_epoch_loop_is_trained_on_by_its_epochs_key(tmp_path, rnn_reference):
    run_dir = tmp_path / "run"
    assert probe([*RNN, "task.epochs=3"], run_dir).returncode == 0
    more = probe([*RNN, "task.epochs=4"], run_dir)
    assert more.returncode == 0, more.stderr[-3000:]
    assert more.result["resumed_from_step"] == 24 and more.result["steps"] == 32
    assert more.result["param_checksum"] == rnn_reference.result["param_checksum"]
    assert json.loads((run_dir / "seen0.json").read_text()) == [[s, s % 8] for s in range(24, 32)]


def test_a_finished_run_is_trained_on_by_its_own_length_key_and_the_message_names_it(tmp_path):
    run_dir = tmp_path / "run"
    first = probe(["task=probe_lengthy", "task.max_iters=6"], run_dir)
    assert first.returncode == 0 and first.result["length_keys"] == ["max_iters"]
    again = probe(["task=probe_lengthy", "task.max_iters=6"], run_dir)
    assert again.returncode == 0 and "a larger task.max_iters trains on" in again.stderr
    longer = probe(["task=probe_lengthy", "task.max_iters=9"], run_dir)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert longer.result["resumed_from_step"] == 6 and longer.result["steps"] == 9
    straight = probe(["task=probe_lengthy", "task.max_iters=9"], tmp_path / "straight")
    assert longer.result["param_checksum"] == straight.result["param_checksum"]


def test_a_loop_to_its_key_inclusive_is_trained_on_by_that_key_and_only_by_it(tmp_path):
    run_dir, nano = tmp_path / "run", ["task=probe_lengthy", "task.inclusive=true"]
    first = probe([*nano, "task.max_iters=6", "task.decay_iters=6"], run_dir)
    assert first.returncode == 0 and first.result["length_keys"] == ["max_iters"], first.stderr[-2000:]
    assert "a larger task.max_iters trains on" in probe([*nano, "task.max_iters=6", "task.decay_iters=6"],
                                                        run_dir).stderr
    # decay_iters equals the length too, but the loop did not grow with it: other settings
    refused = error_line(probe([*nano, "task.max_iters=6", "task.decay_iters=9"], run_dir))
    assert "task.decay_iters=6, now 9" in refused
    longer = probe([*nano, "task.max_iters=9", "task.decay_iters=6"], run_dir)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert longer.result["resumed_from_step"] == 7 and longer.result["steps"] == 10
    straight = probe([*nano, "task.max_iters=9", "task.decay_iters=6"], tmp_path / "straight")
    assert longer.result["param_checksum"] == straight.result["param_checksum"]


def test_a_length_no_key_holds_cannot_be_extended_and_the_message_says_so(tmp_path):
    run_dir = tmp_path / "run"
    assert probe(["task=probe_lengthy", "task.twice=3"], run_dir).returncode == 0
    again = probe(["task=probe_lengthy", "task.twice=3"], run_dir)
    assert "its loop's length is no task parameter" in again.stderr
    refused = error_line(probe(["task=probe_lengthy", "task.twice=4"], run_dir))
    assert "task.twice=3, now 4" in refused and "to train it on" not in refused


def test_parameters_taken_as_one_config_object(tmp_path):
    run = probe(["task=probe_configured", "task.shape.width=8", "task.max_iters=3", "task.tags=[a,b]",
                 "task.seed=7"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["metrics"] == {"lr": 0.05, "width": 8, "depth": 2, "n_tags": 2, "seed": 7, "is_config": 1}
    assert run.result["steps"] == 3 and run.result["length_keys"] == ["max_iters"]
    mapped = probe(["task=probe_mapped", "task.lr=0.25"], tmp_path / "mapped")
    assert mapped.result["metrics"] == {"n_keys": 2, "lr": 0.25}


@pytest.mark.parametrize("args,says", [
    (["task.lrr=1"], "task.lrr: run_probe.configured takes its parameters as cfg: ProbeConfig has no field 'lrr' "
                     "(did you mean task.lr?); its fields: lr, max_iters, shape, tags, seed"),
    (["task.shape.widht=3"], "task.shape.widht: ProbeConfig.shape: Shape has no field 'widht' "
                             "(did you mean task.shape.width?); its fields: width, depth"),
    (["task.max_iters=x"], "task.max_iters='x' is not allowed: an integer"),
])
def test_a_config_object_that_rejects_a_key_names_it_and_its_fields(tmp_path, args, says):
    assert says in error_line(probe(["task=probe_configured", *args], tmp_path / "run"))


def test_verify_says_an_exact_loop_is_exact(tmp_path):
    run = probe([*RNN, "checkpoint.verify=true"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "verify.json").read_text())
    assert report["exact"] and report["stopped_at"] == 16 and report["params_equal"], report
    assert "checkpoint.verify: exact: stopped at step 16 of 32 and resumed" in run.output


def test_verify_names_the_first_step_that_differs_and_the_likely_cause(tmp_path):
    run = probe(["task=probe_prefetching", "checkpoint.verify=true"], tmp_path / "run")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: checkpoint.verify: NOT exact: stopped at step 6 of 12 and resumed, the "
                           "logged rows first differ at step 7"), last
    assert "the first step after the resume" in last and "a batch fetched at the end of a step" in last
    assert json.loads((tmp_path / "run" / "verify.json").read_text())["first_differing_step"] == 7
