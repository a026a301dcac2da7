"""Published training scripts run as script tasks with no line changed (examples/ports/README.md):
nanoGPT's train.py and pytorch/examples' word_language_model, on one rank and in a gpu_pool sweep,
and examples/scripts/ddp_train.py on 2 ranks (and under plain torchrun). Data from local text.
On the local SLURM cluster: tests/script/test_script_slurm.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from script_checkouts import nanogpt, word_language_model

from conftest import REPO, clean_env, expgpu
from expgpu.gpus import inventory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CONF = ["--config-dir", str(REPO / "tests" / "conf")]


@pytest.fixture(scope="module")
def nanogpt_checkout(tmp_path_factory):
    return nanogpt(tmp_path_factory.mktemp("nanogpt"))


@pytest.fixture(scope="module")
def word_lm_checkout(tmp_path_factory):
    return word_language_model(tmp_path_factory.mktemp("word_lm"))


def sweep(args: list[str], sweep_dir: Path, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expgpu", "-m", *args, f"hydra.sweep.dir={sweep_dir}"], cwd=cwd,
                          env=clean_env(EXPGPU_LEASE_DIR=str(sweep_dir.parent / "leases")), capture_output=True,
                          text=True, timeout=timeout)


def test_nanogpt_trains_in_its_run_dir_and_trains_on_with_init_from_resume(nanogpt_checkout, tmp_path):
    run = expgpu([*CONF, "task=script_nanogpt"], tmp_path / "run", cwd=nanogpt_checkout)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "iter 10: loss" in run.stdout and "saving checkpoint to out" in run.stdout
    assert (run.run_dir / "out" / "ckpt.pt").is_file()        # nanoGPT's out/ lands in the run dir
    assert not (nanogpt_checkout / "out").exists()
    assert (run.run_dir / "data").resolve() == nanogpt_checkout / "data"   # task.inputs, linked
    assert run.result["status"] == "finished" and run.result["command"][-1] == "--learning_rate=0.001"

    # more iterations in the same run dir: out/ckpt.pt is there, so init_from=resume is added
    more = expgpu([*CONF, "task=script_nanogpt", "task.args.max_iters=12"], tmp_path / "run", cwd=nanogpt_checkout)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "Overriding: init_from = resume" in more.stdout and "Resuming training from out" in more.stdout
    assert "iter 11: loss" in more.stdout and "iter 5: loss" not in more.stdout   # on from iteration 10
    assert more.result["resumed"] is True and more.result["attempt"] == 1


def test_nanogpt_sweep_on_two_cpu_slots_keeps_each_jobs_outputs_apart(nanogpt_checkout, tmp_path):
    proc = sweep([*CONF, "task=script_nanogpt", "task.args.learning_rate=1e-3,3e-3", "hydra/launcher=gpu_pool",
                  "hydra.launcher.cpu_slots=2"], tmp_path / "sweep", nanogpt_checkout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for n, lr in ((0, "0.001"), (1, "0.003")):
        job = tmp_path / "sweep" / str(n)
        result = json.loads((job / "result.json").read_text())
        assert result["status"] == "finished" and f"--learning_rate={lr}" in result["command"]
        assert (job / "out" / "ckpt.pt").is_file()
        assert f"Overriding: learning_rate = {lr}" in (job / "logs" / "rank0.script.log").read_text()


def test_word_language_model_one_rank_and_a_sweep_on_simulated_gpus(word_lm_checkout, tmp_path):
    run = expgpu([*CONF, "task=script_word_lm"], tmp_path / "run", cwd=word_lm_checkout)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| End of training | test loss" in run.stdout
    assert (run.run_dir / "model.pt").is_file()                         # --save model.pt: in the run dir
    assert f"--data {word_lm_checkout / 'data' / 'wikitext-2'}" in " ".join(run.result["command"])   # made absolute

    sim = "inventory.simulate=[{name:A100,memory_mb:40960},{name:A100,memory_mb:40960}]"
    proc = sweep([*CONF, "task=script_word_lm", "task.args.lr=20,5", "hydra/launcher=gpu_pool", sim],
                 tmp_path / "sweep", word_lm_checkout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    masks = set()
    for n, lr in ((0, "20"), (1, "5")):
        job = tmp_path / "sweep" / str(n)
        result = json.loads((job / "result.json").read_text())
        assert result["status"] == "finished" and result["command"][result["command"].index("--lr") + 1] == lr
        assert (job / "model.pt").is_file()
        masks.add(result["plan"][0]["gpus"][0])
    assert masks == {0, 1}   # both simulated GPUs leased at once, one per job


def test_ddp_example_meets_in_one_group_on_two_ranks_and_logs(tmp_path):
    run = expgpu(["--config-dir", str(REPO / "examples" / "conf"), "task=ddp_script", "launch.nproc_per_node=2",
                  "objective=loss"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks"] == [0, 1]      # all_gather over the script's group
    assert summary["param_sums"][0] == summary["param_sums"][1]           # DDP kept them in step
    res = run.result
    assert res["exit_codes"] == [0, 0] and res["metrics"]["loss"] == pytest.approx(summary["final_loss"])
    assert len(run.metrics()) == summary["steps"]                         # every expgpu.log row, rank 0's
    assert summary["final_loss"] < 0.5


def test_ddp_example_runs_unchanged_under_plain_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc-per-node=2", str(REPO / "examples" / "scripts" / "ddp_train.py"),
                           "--epochs", "2"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranks"] == [0, 1] and summary["param_sums"][0] == summary["param_sums"][1]
    assert not (tmp_path / "metrics.jsonl").exists()                      # expgpu.log: nothing outside expgpu


@pytest.mark.gpu
@pytest.mark.skipif(len(inventory()) < 2, reason="nanoGPT's DDP path puts rank r on cuda:r: needs 2 GPUs")
def test_nanogpt_ddp_on_two_gpus_lands_each_rank_on_its_planned_gpu(nanogpt_checkout, tmp_path):
    run = expgpu([*CONF, "task=script_nanogpt", "launch.nproc_per_node=2", "task.args.device=cuda",
                  "task.args.gradient_accumulation_steps=2", "gpu_map=ranked"], tmp_path / "run", cwd=nanogpt_checkout)
    assert run.returncode == 0, run.stderr[-3000:]
    res = run.result
    assert res["exit_codes"] == [0, 0] and (run.run_dir / "out" / "ckpt.pt").is_file()
    planned = [p["gpus"][0] for p in res["plan"]]
    mask = ",".join(map(str, planned))
    assert f"CUDA_VISIBLE_DEVICES={mask};" in run.output   # rank r's planned GPU at position r: cuda:LOCAL_RANK
