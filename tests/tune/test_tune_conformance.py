"""hydra/sweeper=expgpu_optuna as a drop-in for Hydra's optuna sweeper, from a plain `@hydra.main` app that
knows nothing of expgpu (tests/tune_apps): what Hydra's sweeper documents and tests, checked in our own
words on the files a user reads (optimization_results.yaml, each job's .hydra/, the study's journal), and,
where both can run, against what Hydra's own sweeper produces (from its own directory: tests/helpers/hydra_optuna.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra_optuna import hydra_optuna, with_path  # noqa: F401  (a fixture)

from conftest import REPO, clean_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

APPS = REPO / "tests" / "tune_apps"


def _sweep(app: str, args: list[str], sweep_dir: Path, path: str | None = None, hydras: bool = False):
    """`python tests/tune_apps/APP.py -m ARGS` with expgpu's sweeper (or Hydra's, from `path`)."""
    env = clean_env(EXPGPU_WARM_SERVER="")
    if path:
        env = with_path(env, path)
    sweeper = ["hydra/sweeper=optuna"] if hydras else []
    return subprocess.run([sys.executable, str(APPS / f"{app}.py"), "-m", *sweeper, *args,
                           f"hydra.sweep.dir={sweep_dir}"], cwd=sweep_dir.parent, env=env,
                          capture_output=True, text=True, timeout=200)


def _results(sweep_dir: Path) -> dict:
    return yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())


def _trials(sweep_dir: Path) -> list:
    """The study as Optuna itself reads it from the sweep's journal."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(sweep_dir / "optuna.journal")))
    return optuna.load_study(study_name=str(sweep_dir), storage=storage).trials


def _jobs(sweep_dir: Path) -> list[tuple[list[str], dict]]:
    """(overrides, composed config) of each job, in job order."""
    dirs = sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return [(yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text()),
             yaml.safe_load((d / ".hydra" / "config.yaml").read_text())) for d in dirs]


def _last_line(done) -> str:
    return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""


def test_a_plain_app_returns_the_objective_and_the_best_is_the_studys(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep("quadratic", ["hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=3"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = _trials(sweep)
    assert len(trials) == 12 and {t.state.name for t in trials} == {"COMPLETE"}
    best = min(trials, key=lambda t: t.value)
    assert _results(sweep) == {"name": "optuna", "best_params": best.params, "best_value": best.value}
    for trial, (overrides, cfg) in zip(trials, _jobs(sweep)):   # the value came from what the job composed
        assert trial.value == (cfg["x"] - 1) ** 2 + cfg["y"] ** 2
        assert {"x": cfg["x"], "y": cfg["y"]} == trial.params
    assert {t.params["x"] for t in trials} <= {-2, -1, 0, 1, 2}   # range(-2, 2): both ends in, as Hydra's


def test_a_value_set_on_the_command_line_leaves_the_search_and_every_record(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep("quadratic", ["hydra.sweeper.sampler.seed=0", "y=1"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not searched, as set on the command line: y=1" in done.stdout.splitlines()[0], done.stdout[:500]
    trials = _trials(sweep)
    assert all(set(t.params) == {"x"} for t in trials)   # the study never saw a y that did not run
    assert all(cfg["y"] == 1 and overrides[-1] == "y=1" for overrides, cfg in _jobs(sweep))
    results = _results(sweep)
    assert set(results["best_params"]) == {"x"} and results["best_value"] == 1.0   # x=1, y=1


def test_a_custom_search_space_adds_parameters_each_job_composes(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep("quadratic", ["hydra.sweeper.custom_search_space=quadratic.near_x", "hydra/sweeper/sampler=random",
                                "hydra.sweeper.sampler.seed=1", "max_gap=0.3"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    for trial, (_, cfg) in zip(_trials(sweep), _jobs(sweep)):
        assert set(trial.params) == {"x", "y", "z", "+w"}
        assert abs(trial.params["z"] - trial.params["x"]) <= 0.3
        assert (cfg["z"], cfg["w"]) == (trial.params["z"], trial.params["+w"])
    assert 0 <= _results(sweep)["best_params"]["+w"] <= 1


def test_a_job_that_did_not_compose_its_trials_parameters_fails_loudly(tmp_path):
    # the custom search space suggests z, and the command line also sets z: the job runs z=0.25
    sweep = tmp_path / "sweep"
    done = _sweep("quadratic", ["hydra.sweeper.custom_search_space=quadratic.near_x", "z=0.25"], sweep)
    last = _last_line(done)
    assert done.returncode == 2 and last.startswith("expgpu: error: trial 0: the study records z="), done.stderr[-3000:]
    assert "but the job composed z=0.25" in last and "Traceback" not in done.stderr
    assert [t.state.name for t in _trials(sweep)] == ["FAIL"]


def test_sampler_and_pruner_by_target_from_a_plain_app(tmp_path):
    args = ["hydra.sweeper.sampler={_target_:optuna.samplers.RandomSampler,seed:5}",   # merged over tpe's keys
            "hydra.sweeper.pruner={_target_:optuna.pruners.PercentilePruner,percentile:10.0}",
            "hydra.sweeper.n_trials=5"]
    runs = [_sweep("quadratic", args, tmp_path / name) for name in ("one", "two")]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
        assert "sampler RandomSampler, pruner PercentilePruner" in done.stdout.splitlines()[0]
    # RandomSampler(seed=5) proposes the same trials twice
    assert [t.params for t in _trials(tmp_path / "one")] == [t.params for t in _trials(tmp_path / "two")]


def test_the_groups_of_samplers_and_pruners_are_selectable_from_any_app(tmp_path):
    done = _sweep("quadratic", ["hydra/sweeper/sampler=qmc", "hydra/sweeper/pruner=median", "hydra.sweeper.n_trials=3"],
                  tmp_path / "sweep")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sampler QMCSampler, pruner MedianPruner" in done.stdout.splitlines()[0]


def test_several_objectives_make_the_exact_pareto_front_as_hydras_sweeper_does(tmp_path, hydra_optuna):
    grid = ["hydra/sweeper/sampler=grid"]
    mine = _sweep("pareto", grid, tmp_path / "mine")
    hydras = _sweep("pareto", grid, tmp_path / "hydras", hydra_optuna, hydras=True)
    assert mine.returncode == 0 and hydras.returncode == 0, (mine.stderr[-2000:], hydras.stderr[-2000:])
    points = [(x, y) for x in range(0, 3) for y in range(0, 3)]   # range(0, 2): both ends in
    values = {p: (p[0] ** 2 + p[1] ** 2, (p[0] - 2) ** 2 + (p[1] - 2) ** 2) for p in points}
    front = {p for p, v in values.items() if not any(w[0] <= v[0] and w[1] <= v[1] and w != v for w in values.values())}
    solutions = _results(tmp_path / "mine")["solutions"]
    assert {(s["params"]["x"], s["params"]["y"]) for s in solutions} == front
    assert all(tuple(s["values"]) == values[(s["params"]["x"], s["params"]["y"])] for s in solutions)
    # Hydra's grid leaves range()'s top out: its front is the exact one of the points it covered
    theirs = _results(tmp_path / "hydras")["solutions"]
    covered = {(x, y) for x in range(0, 2) for y in range(0, 2)}
    assert {(s["params"]["x"], s["params"]["y"]) for s in theirs} == \
        {p for p in covered if not any(values[q][0] <= values[p][0] and values[q][1] <= values[p][1] and
                                       values[q] != values[p] for q in covered)}


def test_the_grid_caps_n_trials_covers_each_point_once_and_ends_normally_as_hydras(tmp_path, hydra_optuna):
    args = ["hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=20", "x=choice(-1,1)", "y=choice(-1,0)",
            "z=choice(0,1)"]
    mine = _sweep("quadratic", args, tmp_path / "mine")
    hydras = _sweep("quadratic", args, tmp_path / "hydras", hydra_optuna, hydras=True)
    assert mine.returncode == 0 and hydras.returncode == 0, (mine.stderr[-2000:], hydras.stderr[-2000:])
    assert "n_trials 20 -> 8: GridSampler's grid has 8 point(s)" in mine.stdout
    seen = sorted((t.params["x"], t.params["y"], t.params["z"]) for t in _trials(tmp_path / "mine"))
    assert seen == sorted((x, y, z) for x in (-1, 1) for y in (-1, 0) for z in (0, 1))
    assert len(_jobs(tmp_path / "hydras")) == len(_jobs(tmp_path / "mine")) == 8
    assert _results(tmp_path / "mine") == _results(tmp_path / "hydras") == \
        {"name": "optuna", "best_params": {"x": 1, "y": 0, "z": 0}, "best_value": 0}


@pytest.mark.parametrize("rate", [0.5, 1.0])
def test_max_failure_rate_decides_the_exit_code_as_hydras(tmp_path, hydra_optuna, rate):
    args = ["fail=true", "hydra.sweeper.n_trials=6", "hydra.sweeper.n_jobs=2", "hydra/sweeper/sampler=random",
            "hydra.sweeper.sampler.seed=0"]
    mine = _sweep("quadratic", [*args, f"hydra.sweeper.max_failure_rate={rate}"], tmp_path / "mine")
    # PyPI's newest hydra-optuna-sweeper (1.2.0) predates max_failure_rate (Hydra's main branch has it): it stops
    # at the first failed trial, which is what both rates come to when every trial fails
    hydras = _sweep("quadratic", args, tmp_path / "hydras", hydra_optuna, hydras=True)
    # every trial fails: both stop non-zero, past the rate at once, at 1.0 after all of them (Hydra's finds no best)
    assert mine.returncode == 1 and hydras.returncode != 0, (mine.stderr[-2000:], hydras.stderr[-2000:])
    assert "RuntimeError: asked to fail at x=" in hydras.stderr, hydras.stderr[-2000:]   # a trial's, not a key's
    states, last = [t.state.name for t in _trials(tmp_path / "mine")], _last_line(mine)
    if rate < 1:   # past the rate: the task's own traceback (as Hydra's shows it), then its one-line reason, last
        assert last.startswith("expgpu: the search stopped: 2 of the last 2 trial(s) failed") and states == ["FAIL"] * 2
        assert "first failure: trial 0: RuntimeError: asked to fail at x=" in last
        assert 'raise RuntimeError(f"asked to fail at x={cfg.x}")' in mine.stderr
    else:   # every trial ran: each one's reason is in the log (stdout), as Hydra's sweeper leaves it
        assert last.startswith("expgpu: no trial completed: 6 failed") and states == ["FAIL"] * 6
        assert "asked to fail" not in mine.stderr and "trial 5: failed: RuntimeError: asked to fail" in mine.stdout
        assert "Traceback" not in mine.stderr


def test_a_nan_objective_is_a_failed_trial(tmp_path, hydra_optuna):
    """Optuna refuses nan as a trial's value. Hydra's sweeper (1.2.0, PyPI's newest) then stops the search in a
    traceback of its own (it tells the failed trial with its values); expgpu_optuna fails the trial, and
    max_failure_rate decides: at the default 0 the search stops there, in one line; at 1.0 it goes on."""
    args = ["nan_at=[0]", "hydra.sweeper.n_trials=8", "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=0"]
    stopped = _sweep("quadratic", args, tmp_path / "stopped")
    hydras = _sweep("quadratic", args, tmp_path / "hydras", hydra_optuna, hydras=True)
    assert stopped.returncode == hydras.returncode == 1, (stopped.stderr[-2000:], hydras.stderr[-2000:])
    assert "ValueError: Values were told" in hydras.stderr
    assert _last_line(stopped).endswith("the objective is nan: the run diverged, or its metric is undefined")
    assert "Traceback" not in stopped.stderr
    on = _sweep("quadratic", [*args, "hydra.sweeper.max_failure_rate=1.0"], tmp_path / "on")
    assert on.returncode == 0, on.stderr[-2000:]
    trials = _trials(tmp_path / "on")
    assert {t.state.name for t in trials if t.params["x"] == 0} == {"FAIL"}
    assert {t.state.name for t in trials if t.params["x"] != 0} == {"COMPLETE"}
    assert _results(tmp_path / "on")["best_value"] == min(t.value for t in trials if t.value is not None)


def test_a_failure_over_the_default_rate_stops_the_search_at_that_trial(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep("quadratic", ["fail_at=[2]", "hydra.sweeper.n_trials=12", "hydra.sweeper.sampler.seed=0"], sweep)
    states = [t.state.name for t in _trials(sweep)]
    assert done.returncode == 1 and states[-1] == "FAIL" and set(states[:-1]) <= {"COMPLETE"}, done.stderr[-2000:]
    assert _last_line(done).endswith("RuntimeError: asked to fail at x=2")   # max_failure_rate 0, as Hydra's


def test_an_empty_search_space_runs_n_trials_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep("quadratic", ["hydra.sweeper.params=null", "hydra.sweeper.n_trials=3", "x=1"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [overrides for overrides, _ in _jobs(sweep)] == [["x=1"]] * 3
    assert _results(sweep) == {"name": "optuna", "best_params": {}, "best_value": 0.0}


def test_a_rerun_into_the_same_sweep_dir_says_it_continues_the_study(tmp_path):
    sweep = tmp_path / "sweep"
    first = _sweep("quadratic", ["hydra.sweeper.n_trials=3"], sweep)
    again = _sweep("quadratic", ["hydra.sweeper.n_trials=5"], sweep)
    assert first.returncode == 0 and again.returncode == 0, again.stderr[-2000:]
    assert first.stdout.splitlines()[0].split("] ", 1)[1].startswith(f"study {sweep} in ")
    assert again.stdout.splitlines()[0].split("] ", 1)[1].startswith(
        f"continuing study {sweep} in {sweep / 'optuna.journal'}: 3 trial(s) done, 2 to go")
    assert len(_trials(sweep)) == 5


def test_the_deprecated_search_space_runs_with_hydras_warning(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep("quadratic", ["--config-name=quadratic_old_keys"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "`hydra.sweeper.search_space` is deprecated" in done.stderr
    assert all(set(t.params) == {"x"} and -2 <= t.params["x"] <= 2 for t in _trials(sweep))


def test_a_returned_dict_is_read_through_objective(tmp_path):
    sweep = tmp_path / "sweep"
    done = _sweep("quadratic", ["returns=dict", "+objective=[loss,size]", "hydra.sweeper.direction=[minimize,minimize]",
                                "hydra.sweeper.n_trials=4"], sweep)
    assert done.returncode == 0, done.stderr[-3000:]
    for trial, (_, cfg) in zip(_trials(sweep), _jobs(sweep)):
        assert trial.values[1] == abs(cfg["x"]) + abs(cfg["y"])


@pytest.mark.parametrize("app,args,says", [
    ("pareto", ["hydra.sweeper.direction=minimize"],
     "trial 0: the task returned 2 value(s), but hydra.sweeper.direction has 1"),
    ("quadratic", ["returns=dict"], "trial 0: the task returned a dict (loss, size), not a number"),
    ("quadratic", ["hydra/sweeper/sampler=grid", "z=interval(0,1)"], "hydra/sweeper/sampler=grid: z is sampled from a "
                                                                       "continuous (or log) interval"),
    ("quadratic", ["hydra.sweeper.max_failure_rate=1.5"], "hydra.sweeper.max_failure_rate=1.5 is not allowed"),
    ("quadratic", ["+hydra.sweeper.n_trails=4"], "hydra.sweeper.n_trails: unknown key; allowed under "
                                                 "hydra.sweeper: _target_, defaults, _recursive_, n_trials"),
    ("quadratic", ["+hydra.sweeper.params.z='choice(1,'"], "hydra.sweeper.params.z=choice(1,: not a sweep expression"),
    ("quadratic", ["hydra.sweeper.custom_search_space=quadratic.nope"], "hydra.sweeper.custom_search_space="
                                                                         "quadratic.nope: cannot be found"),
])
def test_bad_input_from_a_plain_app_is_one_line_and_exit_2(tmp_path, app, args, says):
    done = _sweep(app, args, tmp_path / "sweep")
    last = _last_line(done)
    assert done.returncode == 2 and last.startswith("expgpu: error: ") and says in last, done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_an_optuna_too_old_is_one_line_naming_both_versions(tmp_path, hydra_optuna):
    # hydra-optuna-sweeper's own directory holds optuna 2.10, as installing it beside expgpu would
    done = _sweep("quadratic", [], tmp_path / "sweep", hydra_optuna)
    last = _last_line(done)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert last.startswith("expgpu: error: optuna 2.10.1 is installed, but hydra/sweeper=expgpu_optuna needs "
                           "optuna>=5.0") and "hydra-optuna-sweeper pins optuna<3" in last
