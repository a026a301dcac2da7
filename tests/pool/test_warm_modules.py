"""What a gpu_pool's fork server imports ahead for its jobs (pool.spares.task_modules), and when it starts."""

from __future__ import annotations

from config_compose import composed

from expgpu.pool.spares import task_modules
from expgpu.task import RANK_IMPORTS, TRIAL_IMPORTS


def test_a_jobs_torch_expgpu_line_and_task_modules_are_warmed():
    found = task_modules(composed("task=digits"), own_code=True)
    assert found[:len(RANK_IMPORTS)] == RANK_IMPORTS
    assert {"expgpu.tasks.models", "expgpu.tasks.digits", "torch.optim"} <= set(found)
    assert not set(TRIAL_IMPORTS) & set(found)   # a job that is no trial never imports Optuna


def test_a_trials_job_warms_optuna_and_its_reporter_too():
    cfg = composed("task=digits", "++hydra.job.env_set.EXPGPU_TRIAL=/sweep/.expgpu/trial-0.json", hydra=True)
    assert set(TRIAL_IMPORTS) <= set(task_modules(cfg, own_code=True))


def test_on_real_gpus_the_users_modules_are_left_to_the_job():
    found = task_modules(composed("task=digits"), own_code=False)
    assert "expgpu.tasks.digits" in found   # expgpu's own
    user = composed("task=digits", "task.model._target_=mypkg.models.Net")
    assert "mypkg.models" in task_modules(user, own_code=True)
    assert "mypkg.models" not in task_modules(user, own_code=False)


def test_the_fork_server_starts_at_the_launchers_set_up_and_the_first_launch_takes_it(tmp_path):
    """Hydra's sweepers work between the launcher's set-up and its first batch (the basic sweeper composes
    every job of a grid to check it; expgpu_optuna opens its study): the server imports torch meanwhile."""
    import dataclasses
    import importlib

    from expgpu.rundir import STATE
    from hydra_plugins.expgpu_launchers.gpu_pool import GpuPoolLauncher, GpuPoolLauncherConf

    launch = importlib.import_module("expgpu.pool.launch")   # the module (expgpu.pool.launch is also its function)

    sweep = tmp_path / "sweep"
    cfg = composed("task=digits", f"hydra.sweep.dir={sweep}", hydra=True)
    params = {k: v for k, v in dataclasses.asdict(GpuPoolLauncherConf()).items() if k != "_target_"}
    GpuPoolLauncher(**params).setup(hydra_context=None, task_function=None, config=cfg)
    try:
        # kept by its state dir and whether its jobs' GPUs are hidden from it (on a GPU node they are)
        [((state, hide_gpus), ahead)] = launch._kept.items()
        assert state == sweep / STATE and ahead.alive()
        assert launch._server(state, hide_gpus, ["torch"]) is ahead   # what launch() does first
        launch._keep(ahead, state, hide_gpus)
    finally:
        launch._close_kept()   # at exit: a sweep that ended before its first launch (a bad override)
    assert ahead.proc.poll() is not None   # closed with its process group
    assert not sweep.exists()   # made for the server, and left empty: gone


def test_a_kept_server_found_dead_is_replaced_with_its_log_in_the_sweep_dir(tmp_path):
    """Closing the dead one tidies its state dir away (nothing in its log): the new one must not lose it."""
    import importlib
    import os
    import signal

    from expgpu.pool.spares import SPARES_LOG
    from expgpu.rundir import STATE

    launch = importlib.import_module("expgpu.pool.launch")
    state = tmp_path / "sweep" / STATE
    state.mkdir(parents=True)
    dead = launch._server(state, False, [])
    launch._keep(dead, state, False)
    os.killpg(dead.proc.pid, signal.SIGKILL)   # as the kernel's OOM killer would, between two launches
    dead.proc.wait()
    try:
        new = launch._server(state, False, [])
        launch._keep(new, state, False)
        assert new is not dead and new.alive() and (state / SPARES_LOG).exists()
    finally:
        launch._close_kept()
