"""The report of a hydra/sweeper=expgpu_optuna sweep, from what its jobs and study.json leave: trials
ranked by the objective, a pruned one shown with its step and the value it was pruned at, optimization.png
(the objective by trial, pruned trials marked; each parameter against the objective) and the command that
reruns the best."""

from __future__ import annotations

import json

from conftest import write_job
from expgpu.report import main

TRIALS = [  # number, state, lr, layers, accuracy (complete) or the last value reported (pruned)
    (0, "COMPLETE", 0.001, "a", 0.81), (1, "PRUNED", 0.3, "b", 0.12), (2, "COMPLETE", 0.01, "b", 0.93),
    (3, "FAIL", 0.05, "a", None), (4, "PRUNED", 0.2, "a", 0.2)]


def _sweep(sweep):
    trials = []
    for n, state, lr, layers, value in TRIALS:
        overrides = [f"task.optimizer.lr={lr}", f"task.layers={layers}", "task=digits", "objective=accuracy",
                     "hydra/launcher=gpu_pool", f"++hydra.job.env_set.EXPGPU_TRIAL={sweep}/.expgpu/trial-{n}.json"]
        status = {"COMPLETE": "finished", "PRUNED": "pruned", "FAIL": "failed"}[state]
        job = write_job(sweep / str(n), overrides, {"accuracy": value} if state == "COMPLETE" else {},
                        {"accuracy": [(50, 0.5), (100, value or 0.1)]}, status=status, objective="accuracy")
        if state == "PRUNED":
            result = json.loads((job / "result.json").read_text())
            (job / "result.json").write_text(json.dumps({**result, "steps": 100, "stop_signal": "PRUNED"}))
        trials.append({"number": n, "state": state, "params": {"task.optimizer.lr": lr, "task.layers": layers},
                       "values": [value] if state == "COMPLETE" else None,
                       "last_step": 100 if value is not None else None, "last_value": value})
    (sweep / "study.json").write_text(json.dumps({"study": "s", "objective": ["accuracy"],
                                                  "directions": ["maximize"], "trials": trials}))
    for n in range(5):   # the sweeper's direction and the --config-dir given, as Hydra saves them in each job's .hydra/
        (sweep / str(n) / ".hydra" / "hydra.yaml").write_text(
            "hydra:\n  sweeper:\n    direction: maximize\n  job:\n    config_name: config\n  runtime:\n"
            "    config_sources:\n    - {path: hydra.conf, schema: pkg, provider: hydra}\n"
            "    - {path: /src/conf, schema: file, provider: main}\n"
            "    - {path: /home/me/my conf, schema: file, provider: command-line}\n")


def test_trials_ranked_pruned_marked_history_drawn_best_rerun(tmp_path, capsys, monkeypatch):
    import matplotlib.pyplot as plt

    sweep = tmp_path / "sweep"
    _sweep(sweep)
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    table = {line.split()[1]: line.split() for line in out.splitlines()[2:8] if line[:1] in "1-2"}
    assert table["2"][:3] == ["1*", "2", "finished"] and table["0"][:3] == ["2", "0", "finished"]
    assert table["1"][2] == "pruned@100" and table["4"][2] == "pruned@100"
    # a pruned trial: the value its pruner judged (its last reported), in the objective's column, and not ranked
    assert table["1"][:4] == ["-", "1", "pruned@100", "0.12"] and table["4"][:4] == ["-", "4", "pruned@100", "0.2"]
    assert ("rerun the best (job 2): python -m expgpu --config-dir '/home/me/my conf' task.optimizer.lr=0.01 "
            "task.layers=b task=digits objective=accuracy") in out   # neither the launcher nor the trial's variable
    assert (sweep / "optimization.png").exists() and "optimization.png" in (sweep / "report.html").read_text()
    history = figures[-1]
    titles = [ax.get_title() for ax in history.axes if ax.get_visible()]
    assert titles == ["accuracy by trial (higher is better)", "accuracy against task.optimizer.lr",
                      "accuracy against task.layers"]
    first = history.axes[0]
    marks = {c.get_label(): c.get_offsets().tolist() for c in first.collections}
    assert marks["complete"] == [[0, 0.81], [2, 0.93]]
    assert marks["pruned (last reported)"] == [[1, 0.12], [4, 0.2]]
    best_line = first.get_lines()[0].get_ydata().tolist()
    assert best_line[-1] == 0.93   # the best so far, up to the last trial


def test_the_rerun_of_a_trial_whose_config_reads_its_number_keeps_that_number(tmp_path, capsys):
    """A trial seeded by its job's number (task.seed: ${hydra:job.num}) reruns with it: alone, outside a sweep,
    Hydra would leave hydra.job.num null."""
    sweep = tmp_path / "sweep"
    _sweep(sweep)
    for n in range(5):
        hydra = sweep / str(n) / ".hydra"
        (hydra / "config.yaml").write_text("objective: accuracy\ntask:\n  seed: ${hydra:job.num}\n")
        (hydra / "hydra.yaml").write_text((hydra / "hydra.yaml").read_text().replace(
            "  job:\n", f"  job:\n    num: {n}\n"))
    assert main([str(sweep)]) == 0
    assert ("rerun the best (job 2): python -m expgpu --config-dir '/home/me/my conf' hydra.job.num=2 "
            "task.optimizer.lr=0.01 task.layers=b task=digits objective=accuracy") in capsys.readouterr().out
