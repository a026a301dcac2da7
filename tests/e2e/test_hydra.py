"""Hydra as an experienced Hydra user drives it: the less common paths (rerun into a finished run
dir, job_logging in spawned workers, --cfg, site defaults, shell completion for `python -m`,
experiment=, the launcher list). Each test failed on main before it was fixed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, expgpu

pytestmark = pytest.mark.timeout(240)


def _cli(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expgpu", *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=200)


@pytest.mark.slow
def test_rerun_into_a_finished_run_dir_keeps_its_result(tmp_path):
    first = expgpu(["task=a", "task.max_steps=5"], tmp_path / "run")
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "run" / "result.json").read_text()
    again = expgpu(["task=a", "task.max_steps=5"], tmp_path / "run")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "run" / "result.json").read_text() == before     # not 0 steps and final_loss null
    assert f"{tmp_path / 'run'} already holds this task's finished run (5 steps); kept its result.json" in again.stderr
    longer = expgpu(["task=a", "task.max_steps=8"], tmp_path / "run")  # more steps: resumes and trains on
    assert longer.returncode == 0 and longer.result["resumed_from_step"] == 5
    assert longer.result["metrics"]["final_loss"] is not None
    fresh = expgpu(["task=a", "task.max_steps=8", "checkpoint.resume=false"], tmp_path / "run")
    assert fresh.returncode == 0 and fresh.result["resumed_from_step"] is None


@pytest.mark.slow
def test_rerun_of_a_fixed_sweep_dir_keeps_every_jobs_result(tmp_path):
    args = ["-m", "task=a,b", "task.max_steps=5", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    assert _cli(args).returncode == 0
    results = {n: (tmp_path / "sweep" / n / "result.json").read_text() for n in ("0", "1")}
    again = _cli(args)
    assert again.returncode == 0, again.stderr
    assert {n: (tmp_path / "sweep" / n / "result.json").read_text() for n in ("0", "1")} == results
    assert again.stderr.count("already holds this task's finished run") == 2


@pytest.mark.parametrize("logging_choice,shows", [
    ("default", "[expgpu][INFO] - [rank 1] rank 1/2 on"),
    ("stdout", "[rank 1] rank 1/2 on"),
    ("disabled", None),
])
@pytest.mark.slow
def test_spawned_workers_log_as_hydra_job_logging_says(tmp_path, logging_choice, shows):
    run = expgpu(["task=a", "task.max_steps=10", "launch.nproc_per_node=2", f"hydra/job_logging={logging_choice}"],
                 tmp_path / "run")
    assert run.returncode == 0, run.stderr
    if shows is None:   # disabled means disabled: not even the run dir's rank logs
        assert "rank 1/2 on" not in run.output, run.output
        return
    assert shows in run.output, run.output
    assert "rank 1/2 on" in (tmp_path / "run" / "logs" / "rank1.log").read_text()   # also in the run dir


@pytest.mark.slow
def test_a_custom_job_logging_format_reaches_the_workers(tmp_path):
    run = expgpu(["task=a", "task.max_steps=10", "launch.nproc_per_node=2",
                  "hydra.job_logging.formatters.simple.format='CUSTOM %(levelname)s %(message)s'"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert "CUSTOM INFO [rank 1] rank 1/2 on" in run.output, run.output


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--cfg", "all", "--resolve"], ["--cfg", "job"], ["--info", "config"], ["--help"]])
def test_printing_creates_no_directory(tmp_path, flags):
    proc = _cli(flags, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_help_says_what_expgpu_is_and_its_commands_compose(tmp_path):
    shown = _cli(["--help", "task=b"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert out.startswith("expgpu: a PyTorch training task on the right GPUs from config")
    assert out.index("expgpu status [DIR]") < out.index("== Config groups") < out.index("task: a, b, digits")
    assert "_target_: expgpu.tasks.models.WaveCNN" in out   # the overrides' job: task b's config
    assert out.rstrip().endswith("Hydra's own flags and groups: --hydra-help. Versions (for a bug report): --version.")
    commands = [line.split("   ")[0].strip() for line in out.splitlines() if line.startswith("  python -m expgpu")]
    assert len(commands) == 6, out
    for command in commands:   # each composes (a sweep's as one of its jobs): no key or option of it is stale
        words = [w for w in command.split()[3:] if w not in ("-m", "...")]
        words = [w.split("=")[0] + "=" + w.split("=")[1].split(",")[0] if "," in w else w for w in words]
        composed = _cli([*words, "--cfg", "job"], cwd=tmp_path)
        assert composed.returncode == 0, (command, composed.stderr)


def test_version_is_expgpus_with_what_a_bug_report_needs(tmp_path):
    from expgpu import __version__

    shown = _cli(["--version"], cwd=tmp_path)   # Hydra's own flag said only "Hydra 1.3.8"
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"expgpu {__version__} (torch ") and ", hydra-core 1.3." in shown.stdout
    assert shown.stdout.rstrip().endswith(f"; Python {sys.version.split()[0]})") and list(tmp_path.iterdir()) == []


def test_multirun_with_cfg_is_one_line(tmp_path):
    proc = _cli(["-m", "task=a,b", "--cfg", "job"], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("expgpu: error: --cfg prints one config, not a sweep's")


@pytest.mark.slow
def test_slurm_site_defaults_are_read_by_slurm_sweeps_only(tmp_path):
    site = tmp_path / "site" / "hydra" / "launcher" / "slurm_site"
    site.mkdir(parents=True)
    (site / "default.yaml").write_text("partition: gpu-site\naccount: proj-7\n")
    shown = _cli(["--config-dir", str(tmp_path / "site"), "hydra/launcher=slurm", "--cfg", "hydra",
                  "-p", "hydra.launcher"])
    assert shown.returncode == 0, shown.stderr
    assert "partition: gpu-site" in shown.stdout and "account: proj-7" in shown.stdout
    local = expgpu(["--config-dir", str(tmp_path / "site"), "task=a", "task.max_steps=3"], tmp_path / "run")
    assert local.returncode == 0, local.stderr   # a local run never sees hydra.launcher.partition


def test_site_launcher_settings_in_local_default_say_where_they_belong(tmp_path):
    (tmp_path / "site" / "local").mkdir(parents=True)
    (tmp_path / "site" / "local" / "default.yaml").write_text("# @package _global_\nhydra:\n  launcher:\n"
                                                              "    partition: gpu\n")
    run = expgpu(["--config-dir", str(tmp_path / "site"), "task=a", "task.max_steps=3"], tmp_path / "run")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "SLURM site settings belong in hydra/launcher/slurm_site/default.yaml" in run.stderr


@pytest.mark.slow
def test_experiment_needs_no_plus(tmp_path):
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "quick.yaml").write_text("# @package _global_\ntask:\n  max_steps: 4\n")
    run = expgpu(["--config-dir", str(tmp_path / "conf"), "experiment=quick"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert run.result["steps"] == 4


def test_the_launcher_list_shows_launchers_only():
    proc = _cli(["--hydra-help"])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("hydra/launcher:"))
    shown = line.split(": ", 1)[1].split(", ")
    # joblib: Hydra's own, listed where hydra-joblib-launcher is installed (the dev extra); never
    # slurm_site, the group of slurm's site defaults, nor a schema node of expgpu's.
    assert [x for x in shown if x != "joblib"] == ["basic", "gpu_pool", "slurm", "slurm_pool", "submitit_local",
                                                   "submitit_slurm"], line


def test_bash_completion_for_python_m_expgpu(tmp_path):
    script = _cli(["-sc", "install=bash"]).stdout
    line = f"{sys.executable} -m expgpu ta"
    bash = (f"{script}\nCOMP_LINE='{line}'; COMP_WORDS=({line}); COMP_CWORD=3; COMP_POINT=${{#COMP_LINE}}\n"
            "_expgpu_python_m_completion\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n"
            f"COMP_LINE='{line}sk=d'; COMP_WORDS=({line}sk=d); COMP_CWORD=3\n"
            "_expgpu_python_m_completion\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n")
    proc = subprocess.run(["bash", "-c", bash], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["task.", "task=", "task=digits"], (proc.stdout, proc.stderr)
