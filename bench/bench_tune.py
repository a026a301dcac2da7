"""A 24-trial hyperparameter search of the built-in `digits` task (scikit-learn's 8x8 digits, test accuracy on
a held-out 20 %) on 2 CPU slots, four ways, with fixed seeds:

  1. hydra_basic   Hydra's optuna sweeper + the basic launcher (trials one after another, in-process;
                   torch's threads as it starts them, one per core); hydra_basic_1t: the same with
                   OMP_NUM_THREADS=1, a baseline that other processes on a shared machine slow down
                   less (torch's OpenMP threads on every core collapse when another process takes one)
  2. hydra_pool    Hydra's optuna sweeper + gpu_pool (batches of n_jobs=2: a slot waits for its batch)
  3. expgpu        hydra/sweeper=expgpu_optuna on gpu_pool, no pruning (a trial starts when a slot frees)
  4. expgpu_prune  the same with a pruner (median of the earlier trials' accuracy at each evaluation)
     expgpu_asha   the same with asynchronous successive halving (rungs at 200, 600, 1800 steps, 1/3 go on)
  5. ray_asha      Ray Tune's ASHA with TPE (OptunaSearch), the same loop in a Ray trainable
                   (bench/tune_ray_asha.py), when ray[tune] is installed; idle and overhead not measured

    python bench/bench_tune.py [--trials 24] [--steps 3000] [--only expgpu,expgpu_prune]

Search space (3 parameters): task.optimizer.lr in tag(log, interval(1e-4, 3e-1)), task.model.hidden in
choice(16,32,64,128,256), task.batch_size in choice(8,16,32,64); objective=accuracy (maximize), evaluated
every 100 steps (what the pruner judges; from step 200 on). Sampler: TPE, seed 0, the same in all four.
3000 steps make a trial ~1.5 s of training on one core: long enough that the search, not each job's
fixed start-up and Hydra's own start, is what is compared (at 400 steps a trial trains ~0.25 s).

Printed per way: wall time (the whole command), best accuracy, trials finished / pruned, idle slot-time
(1 - the time the 2 slots held a trial / (2 x the sweep's span): gpu_pool's jobs from hand-over to exit,
pool.json; the basic launcher's trials back to back on one slot), and the sweeper's overhead: for each
trial after the first two, its first step minus the end of the latest training that ended before it
(median; result.json's timing: the next trial's own start-up, e.g. its dataset, counts too). Then the ratios the goals are about: (4) against (1) and (2).
Hydra's optuna sweeper pins optuna<3: it runs from a directory of its own (tests/hydra_optuna.py), put
first on its commands' PYTHONPATH. Runs once (each way is minutes): on a shared machine the figures are
noisy; say so when quoting them.
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from hydra_optuna import install, with_path  # noqa: E402

SPACE = ["task.optimizer.lr=tag(log, interval(1e-4, 3e-1))", "task.model.hidden=choice(16,32,64,128,256)",
         "task.batch_size=choice(8,16,32,64)"]
WAYS = {
    "hydra_basic": ["hydra/sweeper=optuna", "hydra.sweeper.n_jobs=1"],
    "hydra_basic_1t": ["hydra/sweeper=optuna", "hydra.sweeper.n_jobs=1"],   # with OMP_NUM_THREADS=1
    "hydra_pool": ["hydra/sweeper=optuna", "hydra.sweeper.n_jobs=2", "hydra/launcher=gpu_pool",
                   "hydra.launcher.cpu_slots=2"],
    "expgpu": ["hydra/sweeper=expgpu_optuna", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2"],
    "expgpu_prune": ["hydra/sweeper=expgpu_optuna", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2",
                     "hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=4",
                     "hydra.sweeper.pruner.n_warmup_steps=200"],
    # ASHA, as Ray Tune's: rungs at 200, 600, 1800 steps, the best third of a rung's trials go on
    "expgpu_asha": ["hydra/sweeper=expgpu_optuna", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2",
                    "hydra/sweeper/pruner=successive_halving", "hydra.sweeper.pruner.min_resource=200",
                    "hydra.sweeper.pruner.reduction_factor=3"],
}


def run_ray(trials: int, steps: int, where: Path) -> dict:
    """Ray Tune's ASHA on the same search (bench/tune_ray_asha.py); wall time of the whole command."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "tune_ray_asha.py"), str(trials), str(steps),
                           str(where / "ray")], cwd=REPO, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"ray_asha failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return {"wall": wall, "idle": float("nan"), "overhead": float("nan"),
            **json.loads(proc.stdout.strip().splitlines()[-1])}


def run_way(name: str, trials: int, steps: int, where: Path, hydra_optuna: str) -> dict:
    if name == "ray_asha":
        return run_ray(trials, steps, where)
    sweep = where / name
    args = [sys.executable, "-m", "expgpu", "-m", *WAYS[name], *SPACE, "task=digits", f"task.max_steps={steps}",
            "task.eval_every=100", "objective=accuracy", "hydra.sweeper.direction=maximize",
            f"hydra.sweeper.n_trials={trials}", "hydra.sweeper.sampler.seed=0", f"hydra.sweep.dir={sweep}",
            "~hydra.callbacks.report"]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("SLURM_", "EXPGPU_"))}
    if name.startswith("hydra"):
        env = with_path(env, hydra_optuna)
    if name.endswith("_1t"):
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return {"wall": wall, **_read(sweep)}


def _read(sweep: Path) -> dict:
    jobs = [json.loads(p.read_text()) for p in sweep.glob("*/result.json")]
    trained = sorted((r["timing"]["first_step_at"], r["timing"]["first_step_at"] + r["timing"]["train_s"])
                     for r in jobs)
    gaps = []   # a trial's first step minus the latest end of training before it (the first wave has none)
    for first, _ in trained[2:]:
        before = [e for _, e in trained if e <= first]
        if before:
            gaps.append(first - max(before))
    best = max((r["metrics"]["accuracy"] for r in jobs if r["status"] == "finished"), default=float("nan"))
    return {"best": best, "finished": sum(r["status"] == "finished" for r in jobs),
            "pruned": sum(r["status"] == "pruned" for r in jobs), "idle": _idle(sweep, trained),
            "overhead": statistics.median(gaps) if gaps else float("nan")}


def _idle(sweep: Path, trained: list[tuple[float, float]]) -> float:
    """1 - the slots' occupied time / (2 slots x the sweep's span). Occupied: gpu_pool's jobs from their
    hand-over to their process's exit (pool.json); the basic launcher's trials, one after another in its
    own process, each from the end of the one before."""
    try:
        spans = [(j["started"], j["ended"]) for j in json.loads((sweep / "pool.json").read_text())["jobs"]]
    except OSError:
        spans = [(prev_end, end) for (_, prev_end), (_, end) in zip([trained[0]] + trained, trained)]
        spans[0] = trained[0]
    window = max(e for _, e in spans) - min(s for s, _ in spans)
    return 1 - sum(e - s for s, e in spans) / (2 * window)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--only", default=",".join([*WAYS, "ray_asha"]))
    a = ap.parse_args()
    ways = a.only.split(",")
    if "ray_asha" in ways and importlib.util.find_spec("ray") is None:
        print("ray_asha: skipped (pip install 'ray[tune]': it pulls no torch)")
        ways.remove("ray_asha")
    hydra_optuna = str(install())
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench_tune_") as tmp:
        for name in ways:
            out[name] = run_way(name, a.trials, a.steps, Path(tmp), hydra_optuna)
            r = out[name]
            print(f"{name:13s} wall {r['wall']:6.1f} s  best accuracy {r['best']:.4f}  finished {r['finished']:2d}  "
                  f"pruned {r['pruned']:2d}  idle slot-time {100 * r['idle']:5.1f} %  "
                  f"overhead (trial end -> next first step, median) {r['overhead']:.3f} s", flush=True)
    for pruned in ("expgpu_prune", "expgpu_asha"):
        p = out.get(pruned)
        for base, goal in (("hydra_basic", 0.33), ("hydra_basic_1t", 0.33), ("hydra_pool", 0.5), ("ray_asha", None)):
            if p and base in out:
                b = out[base]
                print(f"{pruned} / {base}: wall {p['wall'] / b['wall']:.2f}" + (f" (goal <= {goal})" if goal else "")
                      + f", best accuracy {100 * (p['best'] - b['best']):+.2f} points"
                      + (" (goal >= -0.5)" if goal else ""))
    for name in ("expgpu", "expgpu_prune", "expgpu_asha"):
        if name in out:
            print(f"{name}: idle {100 * out[name]['idle']:.1f} % (goal < 5 %), overhead "
                  f"{out[name]['overhead']:.3f} s (goal <= 0.3 s)")


if __name__ == "__main__":
    main()
