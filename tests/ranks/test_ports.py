"""examples/ports/: four public training scripts ported to the Run API, each beside its Lightning
Fabric port. The ports' line counts are what the README says and below Fabric's; each expgpu port,
stopped half-way on 2 ranks and resumed (checkpoint.verify), ends as the run never stopped."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import REPO, clean_env, expgpu

PORTS = REPO / "examples" / "ports"
sys.path.insert(0, str(PORTS))
import count_lines  # noqa: E402
import make_data  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_the_readme_shows_the_counts_count_lines_makes():
    assert count_lines.table() in (PORTS / "README.md").read_text()


@pytest.mark.parametrize("name", list(count_lines.SCRIPTS))
def test_the_expgpu_port_changes_fewer_lines_than_the_fabric_port(name):
    counts = count_lines.count(name)
    assert 0 < counts["expgpu_total"] < counts["fabric"], counts


# Tiny settings: seconds per run on 2 CPU ranks; half of the steps lands inside an epoch.
SETTINGS = {
    "nanogpt": ["task.dataset=shakespeare_char", "task.compile=false", "task.dtype=float32", "task.block_size=32",
                "task.batch_size=4", "task.n_layer=1", "task.n_head=2", "task.n_embd=16", "task.dropout=0.1",
                "task.max_iters=6", "task.lr_decay_iters=6", "task.warmup_iters=2", "task.eval_interval=3",
                "task.eval_iters=2", "task.gradient_accumulation_steps=2", "task.out_dir=out"],
    "word_language_model": ["task.emsize=16", "task.nhid=16", "task.bptt=20", "task.batch_size=4", "task.epochs=3",
                            "task.dropout=0.1", "task.save=model.pt"],
    "vae": ["task.epochs=3", "task.batch_size=64", "task.log_interval=2"],
    "time_sequence_prediction": ["task.steps=2"],
}
DATA = {"nanogpt": {}, "word_language_model": {"words": 1500}, "vae": {"n_train": 500, "n_test": 128},
        "time_sequence_prediction": {"length": 30}}


def _pythonpath(name: str) -> str:
    paths = [str(PORTS / name)]
    if name == "vae" and importlib.util.find_spec("torchvision") is None:
        paths.append(str(PORTS / "offline"))   # the stand-in for the torchvision the VAE imports
    return ":".join(paths)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_expgpu_port_stopped_half_way_on_2_ranks_resumes_exactly(tmp_path, name):
    cwd = tmp_path / name   # the script runs where its data is, as it would in its own directory
    cwd.mkdir()
    (cwd / "results").mkdir()   # the VAE writes its images there
    getattr(make_data, name)(cwd, **DATA[name])
    env = clean_env(PYTHONPATH=_pythonpath(name), TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    run = expgpu(["--config-dir", str(REPO / "examples" / "conf"), f"task={name}", "launch.nproc_per_node=2",
                  "launch.stdout=rank0", "task.log_every=1", "checkpoint.verify=true", *SETTINGS[name]],
                 tmp_path / "run", env=env, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "verify.json").read_text())
    # every rank's parameters, every logged row (one a step) and the returned metrics are the same
    assert report["exact"] and report["params_equal"] and report["rows"] == report["steps"] >= 2, report
    straight = json.loads((tmp_path / "run" / "verify" / "straight" / "result.json").read_text())
    assert straight["world_size"] == 2 and len(set(straight["rank_checksums"])) == 1
