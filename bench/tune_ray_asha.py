"""bench_tune.py's fifth way: the same search with Ray Tune's ASHA scheduler (`pip install 'ray[tune]'`,
which pulls no torch), for comparison. The same model, data and loop as expgpu's built-in `digits` task
(expgpu.tasks: MLP, Digits; Adam, cross-entropy), written plainly in a Ray trainable; the same space and
budget: 24 trials, 2 at once on 2 CPUs, 3000 steps, the test accuracy every 100 steps reported to Tune;
TPE through Ray's OptunaSearch (seeded); ASHA as expgpu_asha's: rungs at steps 200, 600, 1800, reduction factor 3.

    python bench/tune_ray_asha.py TRIALS STEPS OUT_DIR [SEED]

It prints one JSON line: the best accuracy, its trial's params (as expgpu overrides), finished, pruned.

Ray pins its own dependencies: run it from a venv of its own (torch==2.13.0, ray[tune], optuna, scikit-learn,
and this checkout's src on PYTHONPATH); bench_tune.py's --ray-python names that venv's python.
"""

import json
import sys

import torch
import torch.nn.functional as F


def trainable(config: dict) -> None:
    from ray import tune

    from expgpu.tasks.digits import Digits
    from expgpu.tasks.models import MLP

    torch.manual_seed(0)
    train, test = Digits("train"), Digits("test")
    model = MLP(64, 10, hidden=config["hidden"])
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loader = torch.utils.data.DataLoader(train, batch_size=config["batch_size"], shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    step, batches = 0, iter(loader)
    while step < config["steps"]:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 100 == 0:
            with torch.no_grad():
                x, y = test[:]
                accuracy = (model(x).argmax(1) == y).float().mean().item()
            tune.report({"accuracy": accuracy, "step": step})


def main() -> None:
    trials, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    space = {"lr": tune.loguniform(1e-4, 3e-1), "hidden": tune.choice([16, 32, 64, 128, 256]),
             "batch_size": tune.choice([8, 16, 32, 64]), "steps": steps}
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1}), param_space=space,
        tune_config=tune.TuneConfig(metric="accuracy", mode="max", num_samples=trials, max_concurrent_trials=2,
                                    search_alg=OptunaSearch(seed=seed),
                                    scheduler=ASHAScheduler(max_t=steps // 100, grace_period=2, reduction_factor=3)),
        run_config=tune.RunConfig(storage_path=out, verbose=0))
    results = tuner.fit()
    done = [r for r in results if r.metrics and r.metrics.get("step") == steps]
    best = max(done, key=lambda r: r.metrics["accuracy"], default=None)
    params = None if best is None else [f"task.optimizer.lr={best.config['lr']}",
                                        f"task.model.hidden={best.config['hidden']}",
                                        f"task.batch_size={best.config['batch_size']}"]
    print(json.dumps({"best": best.metrics["accuracy"] if best else float("nan"), "params": params,
                      "finished": len(done), "pruned": len(results) - len(done)}))


if __name__ == "__main__":
    main()
