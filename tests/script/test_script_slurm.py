"""Script tasks on the real local SLURM cluster (scripts/slurm-local): nanoGPT through the Hydra launcher,
word_language_model and the DDP example through plain sbatch (scripts/expgpu.sbatch; 2 srun tasks meet
in the script's own process group), and a SIGUSR2 before a time limit: the script stops, rank 0
requeues the job, and the job starts the script again with its resume_args."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from script_checkouts import nanogpt, word_language_model
from slurm_cluster import FINAL, slurm_cluster  # noqa: F401

from conftest import REPO, multirun

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CONF = ["--config-dir", str(REPO / "tests" / "conf")]
SBATCH = str(REPO / "scripts" / "expgpu.sbatch")
SIM = ("inventory.simulate=[{name:A100,memory_mb:81920},{name:H100,memory_mb:81920},"
       "{name:A100,memory_mb:81920},{name:H100,memory_mb:81920}]")


def job_log(cwd: Path, job: str) -> str:
    return (cwd / f"slurm-{job}.out").read_text()


@pytest.mark.timeout(240)
def test_nanogpt_through_the_hydra_slurm_launcher(slurm_cluster, tmp_path):
    checkout = nanogpt(tmp_path / "nanogpt")
    sweep = tmp_path / "sweep"
    proc = multirun([*CONF, "task=script_nanogpt", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=1",
                     "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
                     "hydra.launcher.timeout_min=5"], sweep, slurm_cluster.env, timeout=220, cwd=checkout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert (result["status"], result["source"], result["exit_codes"]) == ("finished", "slurm", [0])
    assert (sweep / "0" / "out" / "ckpt.pt").is_file()   # in the job's own dir
    assert "iter 10: loss" in (sweep / "0" / "logs" / "rank0.script.log").read_text()


@pytest.mark.timeout(120)
def test_the_launchers_dry_run_shows_each_ranks_command_and_a_missing_script_is_one_line(slurm_cluster, tmp_path):
    base = [*CONF, "task=script_probe", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.nodes=2", "gpu_map=ranked", SIM]
    proc = multirun([*base, "dry_run=true", "task.args.data=tests/scripts"], tmp_path / "sweep", slurm_cluster.env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    command = f"{sys.executable} {REPO}/tests/scripts/probe_script.py --steps 3 --data {REPO}/tests/scripts"
    # 2 ranks on each of 2 nodes, each seeing its node's planned GPUs in local-rank order: ranked puts
    # local rank 0 on the H100 (GPU 1), so cuda:LOCAL_RANK is each rank's own
    for rank in range(4):
        assert f"rank {rank}: CUDA_VISIBLE_DEVICES=1,0 {command}" in proc.stdout, proc.stdout
    assert "dry run: nothing submitted" in proc.stdout
    # checked before submitting: a script missing where the sweep was launched from
    proc = multirun([*base, "task.script=nope.py"], tmp_path / "sweep2", slurm_cluster.env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "task.script=nope.py" in lines[0], proc.stderr
    assert not (tmp_path / "sweep2" / ".submitit").exists()


@pytest.mark.timeout(240)
def test_word_language_model_through_sbatch_on_its_slurm_gpu(slurm_cluster, tmp_path):
    checkout = word_language_model(tmp_path / "wlm")
    job = slurm_cluster.sbatch(["--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", SBATCH, *CONF,
                                "task=script_word_lm", SIM], cwd=checkout)
    assert slurm_cluster.wait_job(job, timeout=200) == "COMPLETED", job_log(checkout, job)
    run_dir = checkout / "outputs" / "slurm" / job
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and (run_dir / "model.pt").is_file()
    gpu = result["plan"][0]["gpus"][0]          # the one of SLURM's 4 fake GPUs the job was given
    assert f"(CUDA_VISIBLE_DEVICES={gpu}; its GPU {gpu}: " in job_log(checkout, job)   # that GPU, only it
    assert "| End of training | test loss" in job_log(checkout, job)


@pytest.mark.timeout(240)
def test_ddp_example_as_a_two_task_slurm_job(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", SBATCH,
                                "--config-dir", str(REPO / "examples" / "conf"), "task=ddp_script",
                                f"task.script={REPO / 'examples' / 'scripts' / 'ddp_train.py'}"], cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=200) == "COMPLETED", job_log(tmp_path, job)
    run_dir = tmp_path / "outputs" / "slurm" / job
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks"] == [0, 1]   # both srun tasks in the script's group
    assert summary["param_sums"][0] == summary["param_sums"][1]
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["source"], result["exit_codes"], result["status"]) == ("slurm", [0, 0], "finished")


@pytest.mark.timeout(240)
def test_hydra_app_example_as_a_two_task_slurm_job(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", SBATCH,
                                "--config-dir", str(REPO / "examples" / "conf"), "task=hydra_script",
                                f"task.script={REPO / 'examples' / 'scripts' / 'hydra_train' / 'train.py'}",
                                "task.args.optim=adam"], cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=200) == "COMPLETED", job_log(tmp_path, job)
    run_dir = tmp_path / "outputs" / "slurm" / job
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks"] == [0, 1] and summary["param_sums"][0] == summary["param_sums"][1]
    assert summary["cwd"] == str(run_dir) and summary["config"]["optim"]["name"] == "adam"
    assert "task=hydra_script" in (run_dir / ".hydra" / "overrides.yaml").read_text()   # expgpu's own, kept
    assert "optim=adam" in (run_dir / ".hydra" / "script" / "overrides.yaml").read_text()


@pytest.mark.timeout(300)
def test_sigusr2_stops_the_script_rank_0_requeues_and_it_resumes(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(["--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", SBATCH, *CONF,
                                "task=script_probe_resume",
                                f"task.script={REPO / 'tests' / 'scripts' / 'probe_script.py'}",
                                "task.args.steps=300", "task.args.step-s=0.1", "+task.resume_args.step-s=0.01"],
                             cwd=tmp_path)
    run_dir = tmp_path / "outputs" / "slurm" / job
    deadline = time.monotonic() + 120
    while not ((run_dir / "at-rank0").exists() and int((run_dir / "at-rank0").read_text() or 0) >= 3):
        ended = slurm_cluster.state(job) in FINAL
        assert time.monotonic() < deadline and not ended, job_log(tmp_path, job)
        time.sleep(0.1)
    # 300 steps of 0.1 s: ~30 s for the signal to reach the script (with 40, a CI run once ended before the
    # script had it); the resumed run's steps take 0.01 s (resume_args' value wins over args')
    slurm_cluster.run(["scancel", "--signal=USR2", job])
    assert slurm_cluster.wait_job(job, timeout=200) == "COMPLETED", job_log(tmp_path, job)
    log = job_log(tmp_path, job)
    assert "SIGUSR2, saved step" in log and f"Requeued SLURM job {job}" in log, log
    seen = json.loads((run_dir / "started-rank0.json").read_text())
    assert seen["argv"][-1] == "--resume"
    saved = int((run_dir / "ckpt.txt").read_text())
    assert json.loads((run_dir / "done-rank0.json").read_text()) == {"steps": 300, "first": saved}
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and result["resumed"] is True and result["attempt"] == 1
