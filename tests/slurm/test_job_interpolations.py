"""A job's config that reads Hydra's values for the job (`task.seed: ${hydra:job.num}`, a script's
`--out ${hydra:runtime.output_dir}`) runs under each of expgpu's launchers as under Hydra's basic launcher:
the launcher, which checks every job's config before any starts, resolves it as the job will
(expgpu.pool.job_config), where Hydra sets no HydraConfig for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import slurm_cluster, slurm_cluster_2n  # noqa: F401

from conftest import clean_env

pytestmark = pytest.mark.slow

SCRIPT = '''\
import json, sys
from pathlib import Path

args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
Path(args["--out"], "args.json").write_text(json.dumps(args))
'''

# Each launcher's settings for a 2-job sweep on this machine; the SLURM ones on the local cluster.
LAUNCHERS = {
    "gpu_pool": ([], None),
    "submitit_local": ([], None),
    "slurm": (["hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=5"], "slurm_cluster"),
    "slurm_pool": (["hydra.launcher.nodes=1", "hydra.launcher.gpus_per_node=2", "hydra.launcher.timeout_min=5"],
                   "slurm_cluster_2n"),
}


@pytest.fixture
def launch_dir(tmp_path) -> Path:
    """A config dir with a built-in-loop task seeded and named by its job's number, and a script task whose
    args are its job's number and output dir; the script in the launch dir."""
    task = tmp_path / "conf" / "task"
    task.mkdir(parents=True)
    (task / "numbered.yaml").write_text("defaults:\n  - a\n  - _self_\n\nseed: ${hydra:job.num}\n"
                                        "name: n${hydra:job.num}\nmax_steps: 3\n")
    (task / "its_dir.yaml").write_text("script: s.py\nargs:\n  out: ${hydra:runtime.output_dir}\n"
                                       "  n: ${hydra:job.num}\n")
    (tmp_path / "s.py").write_text(SCRIPT)
    return tmp_path


def _multirun(launch_dir: Path, launcher: str, args: list[str], env: dict, timeout: float = 200):
    extra, _ = LAUNCHERS[launcher]
    return subprocess.run([sys.executable, "-m", "expgpu", "-m", "--config-dir", str(launch_dir / "conf"),
                           f"hydra/launcher={launcher}", *extra, "logger=none", *args,
                           f"hydra.sweep.dir={launch_dir / 'sweep'}"],
                          cwd=launch_dir, env=env, capture_output=True, text=True, timeout=timeout)


def _on(launchers: list[str]) -> list:
    """The launchers as parameters; the SLURM ones marked slurm (the suite runs those on the worker that holds
    the local cluster)."""
    return [pytest.param(name, marks=pytest.mark.slurm) if LAUNCHERS[name][1] else name for name in launchers]


def _env(request, launcher: str) -> dict:
    cluster = LAUNCHERS[launcher][1]
    return request.getfixturevalue(cluster).env if cluster else clean_env()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", _on(list(LAUNCHERS)))
def test_a_jobs_hydra_values_resolve_in_each_launcher_as_in_the_job(launch_dir, launcher, request):
    """Job 0, the built-in loop, is seeded and named by its number (its task checked before it starts, with
    them); job 1's script gets its number and its own dir."""
    done = _multirun(launch_dir, launcher, ["task=numbered,its_dir"], _env(request, launcher))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    sweep = launch_dir / "sweep"
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert (result["status"], result["task_config"]["seed"], result["task_config"]["name"]) == ("finished", 0, "n0")
    assert json.loads((sweep / "1" / "args.json").read_text()) == {"--out": str(sweep / "1"), "--n": "1"}


@pytest.mark.parametrize("launcher", _on(["gpu_pool", "submitit_local", "slurm_pool"]))
def test_a_dry_run_resolves_them_too(launch_dir, launcher, request):
    """The dry run's plan of each job (submitit_local: its memory count of the task's model; slurm_pool:
    where the first jobs go) reads the job's task with its number."""
    done = _multirun(launch_dir, launcher, ["task=numbered,its_dir", "dry_run=true"], _env(request, launcher))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "Traceback" not in done.stderr and "HydraConfig was not set" not in done.stderr + done.stdout
