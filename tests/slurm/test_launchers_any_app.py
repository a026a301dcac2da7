"""expgpu's launchers from a Hydra app that is not expgpu: a tiny @hydra.main app in a temp dir picks
hydra/launcher=slurm or gpu_pool, and its jobs run its function with their own values (submitit_local
stays hydra-submitit-launcher's there: expgpu's is its own app's).
None of expgpu's task/gpu_map/launch checks apply to it; its resources are hydra.launcher's own keys,
and a bad one is one line, exit code 2, as in expgpu's CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from slurm_cluster import slurm_cluster, slurm_cluster_2n  # noqa: F401

from conftest import clean_env

APP = '''\
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    time.sleep(cfg.sleep_s)
    value = cfg.x * 10
    (Path(HydraConfig.get().runtime.output_dir) / "value.txt").write_text(str(value))
    return value


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def app(tmp_path) -> Path:
    """my_app.py and its conf/config.yaml (x, sleep_s), nothing of expgpu's."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("x: 0\nsleep_s: 0\n")
    (tmp_path / "my_app.py").write_text(APP)
    return tmp_path


def sweep(app: Path, args: list[str], env: dict | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "my_app.py", "-m", *args, f"hydra.sweep.dir={app / 'sweep'}"], cwd=app,
                          env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


IN_ALLOCATION = ["hydra/launcher=slurm_pool", "hydra.launcher.gpus_per_node=2", "hydra.launcher.timeout_min=5"]


def in_process(app: Path, args: list[str], env: dict) -> subprocess.CompletedProcess:
    """The app's sweep from a process its command line did not start: run by runpy with a sys.argv of its own."""
    argv = ["my_app.py", "-m", *args, f"hydra.sweep.dir={app / 'sweep'}"]
    code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path('my_app.py', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], cwd=app, env=env, capture_output=True, text=True, timeout=280)


def values(app: Path, jobs: int) -> list[int]:
    return [int((app / "sweep" / str(n) / "value.txt").read_text()) for n in range(jobs)]


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("expgpu: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def launcher_cfg(app: Path, launcher: str) -> dict:
    # (the tests that call it restore Hydra's singletons after: the version base set here would stay)
    with initialize_config_dir(config_dir=str(app / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
        return OmegaConf.to_container(cfg.hydra.launcher)


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_every_expgpu_launcher_is_a_choice_of_any_app(app):
    slurm = launcher_cfg(app, "slurm")
    assert slurm["_target_"] == "hydra_plugins.expgpu_launchers.slurm.ExpgpuSlurmLauncher"
    assert (slurm["max_num_timeout"], slurm["tasks_per_node"], slurm["lost_after_s"]) == (3, None, 60.0)
    assert "defaults" not in slurm
    # hydra-submitit-launcher's own, untouched: expgpu's submitit_local is its own app's only
    assert launcher_cfg(app, "submitit_local")["_target_"] == \
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert launcher_cfg(app, "gpu_pool")["_target_"] == "hydra_plugins.expgpu_launchers.gpu_pool.GpuPoolLauncher"
    assert launcher_cfg(app, "slurm_pool")["_target_"] == "hydra_plugins.expgpu_launchers.slurm_pool.SlurmPoolLauncher"


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_slurm_site_defaults_come_from_the_apps_own_config_dir(app):
    site = app / "conf" / "hydra" / "launcher" / "slurm_site"
    site.mkdir(parents=True)
    (site / "default.yaml").write_text("partition: gpu-site\naccount: proj-7\n")
    cfg = launcher_cfg(app, "slurm")
    assert (cfg["partition"], cfg["account"]) == ("gpu-site", "proj-7")
    assert "partition" not in launcher_cfg(app, "submitit_local")   # read by SLURM sweeps only


def test_a_bad_launcher_setting_of_another_app_is_one_line(app):
    no_slurm = clean_env(PATH=str(Path(sys.executable).parent))
    line = error_line(in_process(app, ["x=1", *IN_ALLOCATION, "hydra.launcher.detach=true"], no_slurm))
    assert "hydra.launcher.detach=true is not allowed here: this sweep was not started by its command line" in line
    line = error_line(sweep(app, ["x=1,2", "hydra/launcher=slurm"], no_slurm))
    assert "needs SLURM's sbatch" in line and "not found on PATH" in line
    line = error_line(sweep(app, ["x=1", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=0"], no_slurm))
    assert "hydra.launcher.tasks_per_node=0 is not allowed: an integer >= 1 or null (1)" in line
    # a key added with + that the launcher would not read: one line, not a sweep that ignores it
    line = error_line(sweep(app, ["x=1", "hydra/launcher=slurm", "+hydra.launcher.gpu_type=a100"], no_slurm))
    assert line.startswith("expgpu: error: hydra.launcher.gpu_type: unknown key; allowed under hydra.launcher: ")
    assert "partition" in line and line.endswith("(a key added with + here is read by nothing)")
    line = error_line(sweep(app, ["x=1", "hydra/launcher=gpu_pool", "+hydra.launcher.gpu=1"], no_slurm))
    assert line.startswith("expgpu: error: hydra.launcher.gpu: unknown key; allowed under hydra.launcher: _target_, "
                           "gpus, gpus_per_job,")
    assert not (app / "sweep" / ".submitit").exists() and not (app / "sweep" / "0").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gpu_pool_runs_another_apps_sweep(app):
    proc = sweep(app, ["x=1,2,3", "hydra/launcher=gpu_pool", "hydra.launcher.gpus_per_job=0",
                       "hydra.launcher.cpu_slots=2"])
    assert proc.returncode == 0, proc.stderr
    assert values(app, 3) == [10, 20, 30]
    assert "gpu_pool: 3 jobs on 2 CPU slots" in proc.stdout   # Hydra's log, on stdout in a plain app


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_slurm_runs_another_apps_sweep(app, slurm_cluster):  # noqa: F811
    proc = sweep(app, ["x=1,2,3", "hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1",
                       "hydra.launcher.timeout_min=5"], slurm_cluster.env, timeout=220)
    assert proc.returncode == 0, proc.stderr
    assert values(app, 3) == [10, 20, 30]
    # hydra.launcher's own keys, as hydra-submitit-launcher reads them: one task, no GPU request
    assert proc.stdout.count("1 node(s) x 1 task(s), GPUs: gres / gpus_per_task (if set)") == 3, proc.stdout
    script = next((app / "sweep" / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "--ntasks-per-node=1" in script and "gpus" not in script and "--partition" not in script


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_unknown_partition_of_another_app_is_one_line(app, slurm_cluster):  # noqa: F811
    line = error_line(sweep(app, ["x=1,2", "hydra/launcher=slurm", "hydra.launcher.partition=nope"],
                            slurm_cluster.env))
    assert "hydra.launcher.partition='nope'" in line and "allowed: debug" in line
    assert not (app / "sweep" / ".submitit").exists()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_cancelled_job_of_another_app_fails_the_sweep(app, slurm_cluster):  # noqa: F811
    name = f"lost-{uuid.uuid4().hex[:8]}"
    proc, jobs = slurm_cluster.sweep_cancelled([sys.executable, "my_app.py", "-m", "x=1", "sleep_s=600",
                                                "hydra/launcher=slurm", "hydra.launcher.lost_after_s=3",
                                                f"hydra.launcher.name={name}", f"hydra.sweep.dir={app / 'sweep'}"],
                                               app, name)
    # expgpu's one line: the job left the queue without a result (submitit alone would wait on)
    assert proc.returncode != 0 and f"job {jobs[0]}" in proc.stderr and "without a result" in proc.stderr, proc.stderr


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurm_pool_runs_another_apps_sweep_in_one_allocation(app, slurm_cluster_2n):  # noqa: F811
    proc = sweep(app, ["x=1,2,3", *IN_ALLOCATION], slurm_cluster_2n.env, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert values(app, 3) == [10, 20, 30]
    pool = json.loads((app / "sweep" / "pool.json").read_text())
    assert [j["state"] for j in pool["jobs"]] == ["finished"] * 3 and pool["allocation"]["job_id"]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurm_pool_called_in_process_sends_the_jobs_themselves(app, slurm_cluster_2n):  # noqa: F811
    """A sweep whose process was not started by its command line (here the app run by runpy with a sys.argv of
    its own, as a notebook or a test runner calls it) has none for the allocation to run again: its jobs go
    there themselves, and launch() returns their results."""
    proc = in_process(app, ["x=1,2,3", *IN_ALLOCATION], slurm_cluster_2n.env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert values(app, 3) == [10, 20, 30]
    assert "slurm_pool: jobs #0..#2 are SLURM job" in proc.stdout, proc.stdout[-3000:]
    assert (app / "sweep" / ".slurm_pool" / "batch-0" / "returns.pkl").exists()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_in_process_study_on_slurm_pool_sends_its_trials_a_batch_at_a_time(app, slurm_cluster_2n):  # noqa: F811
    """expgpu_optuna from a process not started by its command line: the study stays here, and each batch of
    trials goes to an allocation of its own (from a command line the whole study would run in one)."""
    proc = in_process(app, ["hydra/sweeper=expgpu_optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0",
                            "x=range(1,9)", *IN_ALLOCATION], slurm_cluster_2n.env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("are SLURM job") == 2, proc.stdout[-3000:]   # one allocation per trial
    returned = [int((app / "sweep" / str(n) / "value.txt").read_text()) for n in (0, 1)]
    assert f"best_value: {min(returned)}" in (app / "sweep" / "optimization_results.yaml").read_text()
