"""What a gpu_pool's fork server imports ahead for its jobs (pool.spares.task_modules)."""

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
