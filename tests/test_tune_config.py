"""hydra/sweeper=expgpu_optuna's pure parts, in this process: the search space in Hydra's sweep syntax,
the sweeper's keys and their one-line errors, the storage's spelling, how a job's return reads, and the
PRUNED stop request (expgpu.tune, expgpu.stopping)."""

from __future__ import annotations

import pytest

from expgpu import stopping
from expgpu.errors import UserError
from expgpu.tune import settings, space, storage
from expgpu.tune.sweep import outcome


def test_sweep_expressions_become_optuna_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    s = space.parse({"lr": "tag(log, interval(1e-4, 1e-1))", "bs": "choice(16, 32)", "h": "range(32, 129, 32)"},
                    ["task=b", "task.model.k=1,3", "x=interval(0, 1)"])
    d = s.distributions
    assert d["lr"] == FloatDistribution(1e-4, 1e-1, log=True)
    assert d["bs"] == CategoricalDistribution((16, 32))
    assert d["h"] == IntDistribution(32, 128, step=32)           # range's stop is excluded, as in Python
    assert d["task.model.k"] == CategoricalDistribution((1, 3))  # a comma list on the command line
    assert d["x"] == FloatDistribution(0.0, 1.0)
    assert s.fixed == ["task=b"]
    assert s.overrides({"lr": 0.01, "name": "1e-3", "on": True}) == ["lr=0.01", "name='1e-3'", "on=true", "task=b"]


@pytest.mark.parametrize("params,says", [
    ({"lr": "0.1"}, "hydra.sweeper.params.lr=0.1 is not a sweep expression; allowed: interval(a,b)"),
    ({"lr": "interval(0.1"}, "hydra.sweeper.params.lr=interval(0.1: not a sweep expression Hydra can read"),
    ({"lr": "tag(log, interval(0.0, 1.0))"}, "`low > 0` must hold for `log=True`"),
])
def test_a_params_entry_that_is_no_sweep_is_one_line(params, says):
    with pytest.raises(UserError, match=None) as e:
        space.parse(params, [])
    assert says in str(e.value) and "\n" not in str(e.value)


BASE = {"n_trials": 4, "n_jobs": None, "direction": "minimize"}


@pytest.mark.parametrize("change,objective,says", [
    ({"direction": "up"}, "loss", "hydra.sweeper.direction='up' is not allowed: minimize or maximize"),
    ({"n_trials": 0}, "loss", "hydra.sweeper.n_trials=0 is not allowed: an integer >= 1"),
    ({}, None, "objective=None: hydra/sweeper=expgpu_optuna needs the metric to optimize"),
    ({"direction": ["minimize", "maximize"]}, "loss", "names 1 metric(s) but hydra.sweeper.direction"),
    ({"pruner": {"_target_": "optuna.pruners.MedianPruner"}, "direction": ["minimize", "maximize"]}, ["a", "b"],
     "Optuna prunes single-objective studies only"),
    ({"pruner": "median"}, "loss", "hydra.sweeper.pruner='median' is not allowed: {_target_: optuna.pruners.X"),
])
def test_bad_sweeper_keys_are_one_line(change, objective, says):
    with pytest.raises(UserError) as e:
        settings.check({**BASE, **change}, objective)
    assert says in str(e.value), str(e.value)


@pytest.mark.parametrize("node,says", [
    ({"_target_": "optuna.pruners.NoSuchPruner"}, "cannot be imported"),
    ({"_target_": "optuna.pruners.MedianPruner", "n_warmup": 3}, "does not take (n_warmup=3)"),
    ({"_target_": "collections.OrderedDict"}, "made a OrderedDict, not an Optuna pruner"),
])
def test_a_pruner_that_does_not_import_or_takes_other_arguments_is_one_line(node, says):
    with pytest.raises(UserError) as e:
        settings.build(node, "pruner")
    assert says in str(e.value) and str(e.value).startswith("hydra.sweeper.pruner._target_="), str(e.value)


def test_samplers_and_pruners_are_built_by_target():
    import optuna

    assert isinstance(settings.build({"_target_": "optuna.samplers.RandomSampler", "seed": 0}, "sampler"),
                      optuna.samplers.RandomSampler)
    assert isinstance(settings.build({"_target_": "optuna.pruners.HyperbandPruner", "min_resource": 2}, "pruner"),
                      optuna.pruners.HyperbandPruner)
    assert settings.build(None, "pruner") is None


def test_storage_is_a_journal_in_the_sweep_dir_unless_a_url_is_given(tmp_path):
    assert storage.spelled(None, tmp_path) == str(tmp_path / "optuna.journal")
    assert storage.spelled("sqlite:///s.db", tmp_path) == "sqlite:///s.db"
    with pytest.raises(UserError, match=r"hydra.sweeper.storage=sqlite:////nonexistent/dir/s.db: cannot be opened"):
        storage.open_storage("sqlite:////nonexistent/dir/s.db")


def _ret(value=None, error=None):
    from hydra.core.utils import JobReturn, JobStatus

    ret = JobReturn(status=JobStatus.FAILED if error else JobStatus.COMPLETED)
    ret.return_value = error or value
    return ret


def test_a_jobs_return_reads_as_the_trials_state():
    from expgpu.errors import Stopped

    assert outcome(_ret(0.5), 1) == ("COMPLETE", [0.5], "")
    assert outcome(_ret((0.5, 2)), 2) == ("COMPLETE", [0.5, 2.0], "")
    assert outcome(_ret({"status": "pruned", "steps": 7}), 1)[0] == "PRUNED"
    assert outcome(_ret(error=RuntimeError("boom")), 1) == ("FAIL", None, "RuntimeError: boom")
    assert outcome(_ret(error=UserError("objective=x: the task returned no metric 'x'")), 1)[0] == "USER_ERROR"
    wrapped = RuntimeError("job #1 failed")
    wrapped.__cause__ = Stopped({"stop_signal": "SIGINT", "steps": 3, "run_dir": "d"})
    assert outcome(_ret(error=wrapped), 1)[0] == "STOPPED"


def test_a_pruned_request_is_the_weakest_stop():
    s = stopping.Stopper()
    s.request(stopping.PRUNED)
    assert s.should_stop(3) and s.agreed == "PRUNED" and s.exit_code == 0
    s = stopping.Stopper()
    s.request("SIGTERM")
    s.request(stopping.PRUNED)   # a signal that came with it wins: the run is resumable, not pruned
    assert s.should_stop(3) and s.agreed == "SIGTERM" and s.exit_code == 143


def test_importing_the_plugin_does_not_import_optuna():
    import subprocess
    import sys

    code = ("import sys, hydra_plugins.expgpu_sweeper.expgpu_optuna, expgpu.metrics; "
            "print('optuna' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
