"""Hydra's own launcher suites (hydra.test_utils.launcher_common_tests) on expgpu's launchers, used as
Hydra's launcher plugins use them on theirs (hydra-submitit-launcher, hydra-joblib-launcher): subclass
the suite, parametrize the launcher. The apps are Hydra's test apps, not expgpu's: gpu_pool on CPU
slots, slurm on the real local cluster.

LauncherTestSuite runs its sweeps in this process (hydra_sweep_runner); IntegrationTestSuite writes a
small @hydra.main app and runs it as a child process, which inherits this process's environment.
No test of either suite is skipped. slurm_pool runs both ways: from a command line (IntegrationTestSuite) the
allocation runs it again; in-process (LauncherTestSuite) each launch() sends its jobs to an allocation."""

from __future__ import annotations

import pytest
from hydra.core.singleton import Singleton
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from hydra.version import VersionBase
from slurm_cluster import slurm_cluster  # noqa: F401

# CPU slots, also on a machine with GPUs: the suites' jobs use none.
GPU_POOL = ["hydra.launcher.gpus_per_job=0", "hydra.launcher.cpu_slots=2"]
# A job that hangs is cut by SLURM, not waited for until the test's timeout.
SLURM = ["hydra.launcher.timeout_min=5", "hydra.launcher.cpus_per_task=1"]
SLURM_POOL = ["hydra.launcher.timeout_min=5", "hydra.launcher.gpus_per_node=2"]
QUIET = ["hydra/hydra_logging=disabled", "hydra/job_logging=disabled"]


@pytest.fixture(autouse=True)
def unset_version_base(monkeypatch):
    """Each test starts with Hydra's version base unset, as in the process of its own where Hydra's
    plugins run these suites: the suites' apps give none, so Hydra 1.1's defaults apply (a job runs in
    its job dir), but a test before this one in the same process may have composed with
    version_base="1.3" (hydra.job.chdir=false), and that stays in a Hydra singleton. Without it,
    Hydra makes a fresh one (VersionBase() would hand back the same)."""
    monkeypatch.delitem(Singleton._instances, VersionBase, raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("launcher_name, overrides", [("gpu_pool", GPU_POOL)])
class TestGpuPoolLauncher(LauncherTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", *QUIET, "hydra/launcher=gpu_pool", *GPU_POOL])])
class TestGpuPoolLauncherIntegration(IntegrationTestSuite):
    pass


class OnTheCluster:
    """The local cluster's SLURM_CONF, and its sbatch first on PATH, in this process's environment: the
    suites submit from this process, or from a child that inherits its environment."""

    @pytest.fixture(autouse=True)
    def _cluster_env(self, slurm_cluster, monkeypatch):  # noqa: F811 (the fixture imported above)
        for key in ("SLURM_CONF", "PATH"):
            monkeypatch.setenv(key, slurm_cluster.env[key])


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("launcher_name, overrides", [("slurm", SLURM)])
class TestSlurmLauncher(OnTheCluster, LauncherTestSuite):
    pass


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", *QUIET, "hydra/launcher=slurm", *SLURM])])
class TestSlurmLauncherIntegration(OnTheCluster, IntegrationTestSuite):
    pass


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", *QUIET, "hydra/launcher=slurm_pool",
                                                                 *SLURM_POOL])])
class TestSlurmPoolLauncherIntegration(OnTheCluster, IntegrationTestSuite):
    pass


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("launcher_name, overrides", [("slurm_pool", SLURM_POOL)])
class TestSlurmPoolLauncher(OnTheCluster, LauncherTestSuite):
    pass
