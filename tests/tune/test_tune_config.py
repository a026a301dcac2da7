"""hydra/sweeper=expgpu_optuna's pure parts, in this process: the search space in Hydra's sweep syntax,
the sweeper's keys and their one-line errors, the storage's spelling, how a job's return reads, and the
PRUNED stop request (expgpu.tune, expgpu.procs.stop_signals)."""

from __future__ import annotations

import json

import pytest

from expgpu.errors import UserError
from expgpu.procs import stop_signals
from expgpu.train.agreement import StopAgreement
from expgpu.tune import settings, space, storage
from expgpu.tune.sweep import outcome


def test_sweep_expressions_become_optuna_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    s = space.parse({"lr": "tag(log, interval(1e-4, 1e-1))", "bs": "choice(16, 32)", "h": "range(32, 129, 32)"},
                    ["task=b", "task.model.k=1,3", "x=interval(0, 1)"])
    d = s.distributions
    assert d["lr"] == FloatDistribution(1e-4, 1e-1, log=True)
    assert d["bs"] == CategoricalDistribution((16, 32))
    assert d["h"] == IntDistribution(32, 128, step=32)           # the top snapped onto the step's grid
    assert d["task.model.k"] == CategoricalDistribution((1, 3))  # a comma list on the command line
    assert d["x"] == FloatDistribution(0.0, 1.0)
    assert s.fixed == ["task=b"] and s.taken_out == []
    assert s.overrides({"lr": 0.01, "name": "1e-3", "on": True}) == ["lr=0.01", "name='1e-3'", "on=true", "task=b"]


@pytest.mark.parametrize("expr,made", [
    # both ends in, for ints and floats alike, as Hydra's optuna sweeper samples them
    ("range(1,3)", ("int", 1, 3, 1)),
    ("range(0, 10, 5)", ("int", 0, 10, 5)),
    ("range(0, 11, 5)", ("int", 0, 10, 5)),
    ("range(0.5, 5.5, step=1)", ("float", 0.5, 5.5, 1.0)),
    ("range(-5.5, 5.5, step=0.5)", ("float", -5.5, 5.5, 0.5)),
    ("range(0.1, 0.3, 0.1)", ("float", 0.1, 0.3, 0.1)),
    ("int(interval(1, 5))", ("int", 1, 5, 1)),
    ("interval(1, 5)", ("float", 1.0, 5.0, None)),
])
def test_range_and_interval_include_both_ends(expr, made):
    from optuna.distributions import FloatDistribution, IntDistribution

    d = space.parse({"k": expr}, []).distributions["k"]
    kind, low, high, step = made
    assert isinstance(d, IntDistribution if kind == "int" else FloatDistribution), d
    assert (d.low, d.high) == pytest.approx((low, high)) and d.step == pytest.approx(step)


def test_shuffled_ranges_and_choices_are_categorical():
    from optuna.distributions import CategoricalDistribution

    d = space.parse({}, ["a=shuffle(range(1,3))", "b=choice(true, false)", "c=choice('hello', 'world')"]).distributions
    assert set(d["a"].choices) == {1, 2}   # Hydra's own values of range(1,3): shuffle() keeps them
    assert d["b"] == CategoricalDistribution((True, False)) and d["c"] == CategoricalDistribution(("hello", "world"))


def test_a_plain_value_on_the_command_line_takes_its_key_out_of_the_search():
    s = space.parse({"x": "range(-2, 2)", "y": "choice(-5, 0, 5)", "z": "interval(0, 1)"}, ["y=0", "+z=0.5", "w=1,2"])
    assert list(s.distributions) == ["x", "w"]
    assert s.fixed == ["y=0", "+z=0.5"] and s.taken_out == ["y=0", "+z=0.5"]
    assert s.overrides({"x": 1, "w": 2}) == ["x=1", "w=2", "y=0", "+z=0.5"]   # the fixed values come last


def test_a_sweep_on_the_command_line_replaces_the_params_one_and_a_plain_params_entry_is_fixed():
    from optuna.distributions import CategoricalDistribution

    s = space.parse({"x": "range(-2, 2)", "seed": 7}, ["x=choice(0,1)"])
    assert s.distributions == {"x": CategoricalDistribution((0, 1))}
    assert s.fixed == ["seed=7"] and s.taken_out == []


def test_the_deprecated_search_space_mappings_are_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    d = space.parse({"x": {"type": "float", "low": -5.5, "high": 5.5, "step": 0.5},
                     "n": {"type": "int", "low": 1, "high": 100, "log": True},
                     "c": {"type": "categorical", "choices": ["a", "b"]}}, []).distributions
    assert d == {"x": FloatDistribution(-5.5, 5.5, step=0.5), "n": IntDistribution(1, 100, log=True),
                 "c": CategoricalDistribution(("a", "b"))}
    with pytest.raises(UserError, match=r"hydra.sweeper.search_space.q.type='normal' is not allowed"):
        space.parse({"q": {"type": "normal", "low": 0, "high": 1}}, [])


def test_settings_take_search_space_with_hydras_deprecation_warning_and_prefer_params():
    with pytest.warns(UserWarning, match="`hydra.sweeper.search_space` is deprecated"):
        s = settings.check({**BASE, "params": {}, "search_space": {"x": {"type": "int", "low": 0, "high": 3}}}, None)
    assert s.params == {"x": {"type": "int", "low": 0, "high": 3}}
    with pytest.warns(UserWarning, match="Both hydra.sweeper.params and hydra.sweeper.search_space are configured"):
        s = settings.check({**BASE, "params": {"y": "choice(1,2)"}, "search_space": {"x": {"type": "int"}}}, None)
    assert s.params == {"y": "choice(1,2)"}


def test_a_grid_is_every_value_under_the_same_rule_and_a_continuous_parameter_has_none():
    s = space.parse({"x": "choice(-1, 1)", "y": "range(-1.0, 1.0, step=1)", "n": "int(interval(1, 3))",
                     "z": "choice(foo, bar)"}, [])
    assert space.grid_of(s) == {"x": [-1, 1], "y": [-1.0, 0.0, 1.0], "n": [1, 2, 3], "z": ["foo", "bar"]}
    with pytest.raises(UserError, match="hydra/sweeper/sampler=grid: lr is sampled from a continuous"):
        space.grid_of(space.parse({"lr": "interval(0.1, 1)"}, []))


@pytest.mark.parametrize("params,says", [
    ({"lr": "interval(0.1"}, "hydra.sweeper.params.lr=interval(0.1: not a sweep expression Hydra can read"),
    ({"lr": "tag(log, interval(0.0, 1.0))"}, "`low > 0` must hold for `log=True`"),
    ({"lr": "range(5, 1)"}, "hydra.sweeper.params.lr=range(5, 1): range(5, 1, 1) needs start <= stop and a step > 0"),
])
def test_a_params_entry_that_is_no_sweep_is_one_line(params, says):
    with pytest.raises(UserError, match=None) as e:
        space.parse(params, [])
    assert says in str(e.value) and "\n" not in str(e.value)


BASE = {"n_trials": 4, "n_jobs": None, "direction": "minimize"}


@pytest.mark.parametrize("change,objective,says", [
    ({"direction": "up"}, "loss", "hydra.sweeper.direction='up' is not allowed: minimize or maximize"),
    ({"n_trials": 0}, "loss", "hydra.sweeper.n_trials=0 is not allowed: an integer >= 1"),
    ({}, 3, "objective=3 is not allowed: the name of a metric the task returns in a dict"),
    ({"direction": ["minimize", "maximize"]}, "loss", "names 1 metric(s) but hydra.sweeper.direction"),
    ({"pruner": {"_target_": "optuna.pruners.MedianPruner"}, "direction": ["minimize", "maximize"]}, None,
     "Optuna prunes single-objective studies only"),
    ({"pruner": "median"}, "loss", "hydra.sweeper.pruner='median' is not allowed: {_target_: optuna.pruners.X"),
    ({"max_failure_rate": 1.5}, None, "hydra.sweeper.max_failure_rate=1.5 is not allowed: a fraction from 0 to 1"),
    ({"max_failure_rate": -0.1}, None, "hydra.sweeper.max_failure_rate=-0.1 is not allowed"),
    ({"study_name": ""}, None, "hydra.sweeper.study_name='' is not allowed: a name, or null (the sweep dir's path"),
    ({"study_name": [1]}, None, "hydra.sweeper.study_name=[1] is not allowed"),
])
def test_bad_sweeper_keys_are_one_line(change, objective, says):
    with pytest.raises(UserError) as e:
        settings.check({**BASE, **change}, objective)
    assert says in str(e.value), str(e.value)


def test_the_objective_is_optional_and_hydras_defaults_hold():
    s = settings.check({**BASE, "direction": ["minimize", "maximize"]}, None)
    assert s.objective is None and s.directions == ("minimize", "maximize") and s.metric is None
    assert s.max_failure_rate == 0.0   # Hydra's optuna sweeper's default: a failed trial stops the search
    assert settings.check(BASE, "accuracy").metric == "accuracy"
    assert settings.check({**BASE, "study_name": 2024}, None).study_name == "2024"   # as Hydra reads it


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


def test_a_null_key_is_not_passed_and_tpe_lies_constantly_unless_told_otherwise():
    import optuna

    # the tpe group option's keys merged under another _target_: only the keys given reach it
    made = settings.build({"_target_": "optuna.samplers.RandomSampler", "seed": 3, "n_startup_trials": None,
                           "constant_liar": None}, "sampler")
    assert isinstance(made, optuna.samplers.RandomSampler)
    assert settings.build({"_target_": "optuna.samplers.TPESampler", "constant_liar": None}, "sampler")._constant_liar
    told = settings.build({"_target_": "optuna.samplers.TPESampler", "constant_liar": False}, "sampler")
    assert not told._constant_liar


def test_grid_samplers_config_is_partial_and_nothing_else_may_be():
    import functools

    import optuna

    made = settings.build({"_target_": "optuna.samplers.GridSampler", "_partial_": True, "seed": None}, "sampler")
    assert isinstance(made, functools.partial) and made.func is optuna.samplers.GridSampler
    with pytest.raises(UserError, match="only GridSampler's config is partial"):
        settings.build({"_target_": "optuna.samplers.TPESampler", "_partial_": True}, "sampler")


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
    assert outcome(_ret(float("nan")), 1) == ("FAIL", None, "the objective is nan: the run diverged, or its metric "
                                                           "is undefined")
    assert outcome(_ret({"loss": float("nan")}), 1, ("loss",))[2].startswith("the objective is nan (loss)")
    assert outcome(_ret(float("inf")), 1) == ("COMPLETE", [float("inf")], "")   # Optuna takes it, as the worst
    assert outcome(_ret({"status": "pruned", "steps": 7}), 1)[0] == "PRUNED"
    assert outcome(_ret(error=RuntimeError("boom")), 1) == ("FAIL", None, "RuntimeError: boom")
    assert outcome(_ret(error=UserError("objective=x: the task returned no metric 'x'")), 1)[0] == "USER_ERROR"
    wrapped = RuntimeError("job #1 failed")
    wrapped.__cause__ = Stopped({"stop_signal": "SIGINT", "steps": 3, "run_dir": "d"})
    assert outcome(_ret(error=wrapped), 1)[0] == "STOPPED"


def test_a_returned_dict_gives_the_named_metrics_and_is_one_line_without_them():
    assert outcome(_ret({"acc": 0.9, "loss": 0.1}), 2, ("loss", "acc")) == ("COMPLETE", [0.1, 0.9], "")
    state, _, reason = outcome(_ret({"acc": 0.9}), 1)
    assert state == "USER_ERROR" and "the task returned a dict (acc), not a number: name the metric" in reason
    state, _, reason = outcome(_ret({"acc": 0.9}), 1, ("loss",))
    assert state == "USER_ERROR" and reason.startswith("objective=loss: the task returned no metric 'loss'")


def test_a_value_count_that_is_not_the_directions_is_one_line_and_a_non_number_fails_the_trial():
    state, _, reason = outcome(_ret((1.0, 2.0)), 1)
    assert state == "USER_ERROR" and "returned 2 value(s), but hydra.sweeper.direction has 1" in reason
    assert outcome(_ret("high"), 1)[0] == "FAIL"
    assert outcome(_ret(None), 1)[0] == "FAIL"


def test_a_pruned_request_is_the_weakest_stop():
    s = stop_signals.StopSignals()
    s.request(stop_signals.PRUNED)
    assert StopAgreement(s).should_stop(3) and s.agreed == "PRUNED" and s.exit_code == 0
    s = stop_signals.StopSignals()
    s.request("SIGTERM")
    s.request(stop_signals.PRUNED)   # a signal that came with it wins: the run is resumable, not pruned
    assert StopAgreement(s).should_stop(3) and s.agreed == "SIGTERM" and s.exit_code == 143


def test_importing_the_plugin_does_not_import_optuna():
    import subprocess
    import sys

    code = ("import sys, hydra_plugins.expgpu_sweeper.expgpu_optuna, expgpu.loggers.jsonl; "
            "print('optuna' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def _reporter(tmp_path, monkeypatch, pruner: dict, completed: int = 0):
    """A trial of a study in a journal (after `completed` trials that completed), with a TrialReporter on its file as
    rank 0 of its job has one, and the StopSignals it would request a prune of: (study, reporter, signals)."""
    import optuna

    from expgpu.tune.bridge import TrialReporter

    journal = str(tmp_path / "optuna.journal")
    study = optuna.create_study(study_name="s", storage=storage.open_storage(journal))
    for _ in range(completed):
        done = study.ask()
        done.report(1.0, 10)
        study.tell(done, 1.0)
    trial = study.ask()
    spec = {"storage": journal, "study": "s", "trial_id": trial._trial_id, "number": trial.number,
            "objective": "loss", "pruner": pruner, "params": {}}
    (tmp_path / "trial.json").write_text(json.dumps(spec))
    signals = stop_signals.StopSignals()
    monkeypatch.setattr(stop_signals, "_current", signals)
    return study, TrialReporter.attach(str(tmp_path / "trial.json")), signals


@pytest.mark.parametrize("max_steps,pruned", [(10, False), (20, True)])
def test_a_trial_is_not_pruned_at_its_last_step(tmp_path, monkeypatch, max_steps, pruned):
    """At its last step a trial has paid for its training: pruning it there would only lose its objective."""
    study, reporter, signals = _reporter(tmp_path, monkeypatch, {"_target_": "optuna.pruners.ThresholdPruner",
                                                                 "upper": 0.5})
    reporter.write([{"step": 10, "loss": 0.9, "max_steps": max_steps}])   # above the threshold
    assert (signals.received == stop_signals.PRUNED) is pruned
    assert study.trials[0].intermediate_values == {10: 0.9}   # reported either way


@pytest.mark.parametrize("pruner", [{"_target_": "optuna.pruners.ThresholdPruner", "upper": 1e9},
                                    {"_target_": "optuna.pruners.SuccessiveHalvingPruner", "min_resource": 10},
                                    {"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 0}])
def test_a_trial_whose_objective_becomes_nan_is_pruned_as_optuna_prunes_it(tmp_path, monkeypatch, pruner):
    """A diverged trial's nan is reported as an Optuna objective reports it, and Optuna's pruners prune on it: left
    out, the trial trained to its end, and its nan objective then failed it (at max_failure_rate 0, the search)."""
    import math

    # one completed trial first: the median pruner judges none before one has completed
    study, reporter, signals = _reporter(tmp_path, monkeypatch, pruner, completed=1)
    reporter.write([{"step": 10, "loss": float("nan"), "max_steps": 100}])
    assert signals.received == stop_signals.PRUNED
    assert math.isnan(study.trials[1].intermediate_values[10])


def test_a_script_writes_the_rows_its_trials_pruner_judges_at_once(tmp_path):
    # expgpu.log in a script (rank 0): rows are written at most once a second, but those holding the objective its
    # supervisor named (EXPGPU_SCRIPT_PROMPT, a trial's) at once, where the supervisor reports them to the pruner
    from expgpu.script.log import _ScriptLog

    def written(env: dict) -> list:
        run_dir = tmp_path / str(len(env))
        run_dir.mkdir()
        log = _ScriptLog.from_env({"EXPGPU_SCRIPT_RUN_DIR": str(run_dir), "RANK": "0", **env})
        for step in (1, 2, 3):
            log.log(step, {"score": 0.5} if step == 3 else {"loss": 1.0})
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        log.close()
        return [r["step"] for r in rows]

    assert written({}) == []                                         # none yet: handed over within a second
    assert written({"EXPGPU_SCRIPT_PROMPT": "score"}) == [1, 2, 3]   # the objective's row, and what came before it
