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
     expgpu_asha100 the same from step 100 (rungs at 100, 300, 900, 2700 steps, 1/3 go on)
     expgpu_asha2  the same, halving (rungs at 200, 400, 800, 1600 steps, 1/2 go on)
  5. ray_asha      Ray Tune's ASHA with TPE (OptunaSearch), the same loop in a Ray trainable
                   (bench/tune_ray_asha.py), run by --ray-python (a venv with ray[tune]: Ray pins its own
                   dependencies) or this python when it has ray; idle and overhead not measured

    python bench/bench_tune.py [--trials 24] [--steps 3000] [--seeds 0,1,2] [--only hydra_pool,expgpu_prune]
                               [--ray-python /path/to/ray-venv/bin/python] [--keep DIR] [--retrain 5]
                               [--way 'sha4=hydra/sweeper/pruner=successive_halving
                                       hydra.sweeper.pruner.reduction_factor=4']

Seeds are the outer loop and ways the inner one (seed 0: every way, then seed 1: ...), so on a shared
machine each way of a seed runs under about the same load as the others: the ratios are taken per
seed, against the baseline of the same seed, and their median is shown beside the ratio of medians.
--way adds a way of one's own: expgpu_optuna on gpu_pool's 2 slots with these overrides (repeatable).

Search space (3 parameters): task.optimizer.lr in tag(log, interval(1e-4, 3e-1)), task.model.hidden in
choice(16,32,64,128,256), task.batch_size in choice(8,16,32,64); objective=accuracy (maximize), evaluated
every 100 steps (what the pruner judges; from step 200 on). Sampler: TPE, the same seeds in every way: each
way runs once per seed (--seeds), and its figures are the medians over them (a search's best depends on its
seed more than on anything compared here).
3000 steps make a trial ~1.5 s of training on one core: long enough that the search, not each job's
fixed start-up and Hydra's own start, is what is compared (at 400 steps a trial trains ~0.25 s).

Printed per way and seed as it ends, then per way: wall time (the whole command), its start (the command's
start to the first trial's; the same pool and Hydra in every way), best accuracy, trials finished / pruned,
idle slot-time before the tail (1 - the time the 2 slots held a trial / (2 x the span from the first trial's
start to the last trial's start): gpu_pool's jobs from hand-over to exit, pool.json; the basic launcher's
trials back to back on one slot), the tail apart (from the last trial's start to the sweep's end: no scheduler
fills a slot there without trials beyond n_trials), and the sweeper's overhead: for each trial after the first
two, its first step minus the end of the latest training that ended before it (median; result.json's timing:
the next trial's own start-up, e.g. its dataset, counts too); per seed also the slot-seconds the trials held
(their jobs' walls), the CPU seconds of the command and its processes, the steps its trials trained (the work,
whatever the load), and the part of the held slot-seconds spent training (first step to last): the rest is
each trial's start and end, paid by a pruned trial as by a finished one. Then the ratios the goals are about,
medians against medians: (4) against (1), (2) and (5); the pruned asynchronous way's median best within 0.5
points of (2)'s at <= 0.4x its wall time.
Then (--retrain N, default 5; after the timed runs) each way's best trial's hyperparameters are trained again
with task.seed 1..N (its trial ran with 0), and their mean test accuracy is shown beside the best: what the
search found, apart from the luck of one run. A trial's final accuracy moves by a point or more with the seed
alone, so the best of 24 finished trials is partly the best of 24 draws, and a pruned search that finishes 4
has fewer draws; the retrained accuracy compares the hyperparameters the ways chose.
Hydra's optuna sweeper pins optuna<3: it runs from a directory of its own (tests/helpers/hydra_optuna.py), put
first on its commands' PYTHONPATH. Runs once (each way is minutes): on a shared machine the figures are
noisy; say so when quoting them.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import pythonpath

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from hydra_optuna import install, with_path  # noqa: E402

SPACE = ["task.optimizer.lr=tag(log, interval(1e-4, 3e-1))", "task.model.hidden=choice(16,32,64,128,256)",
         "task.batch_size=choice(8,16,32,64)"]
SEARCHED = [entry.split("=")[0] for entry in SPACE]
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
    # the same by thirds from the first evaluation: rungs at 100, 300, 900, 2700 steps (a pruned trial costs less,
    # a rung's judgement is noisier)
    "expgpu_asha100": ["hydra/sweeper=expgpu_optuna", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2",
                       "hydra/sweeper/pruner=successive_halving", "hydra.sweeper.pruner.min_resource=100",
                       "hydra.sweeper.pruner.reduction_factor=3"],
    # the original successive halving: the better half of a rung's trials go on (rungs at 200, 400, 800, 1600)
    "expgpu_asha2": ["hydra/sweeper=expgpu_optuna", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2",
                     "hydra/sweeper/pruner=successive_halving", "hydra.sweeper.pruner.min_resource=200",
                     "hydra.sweeper.pruner.reduction_factor=2"],
}


def run_ray(trials: int, steps: int, seed: int, where: Path, python: str) -> dict:
    """Ray Tune's ASHA on the same search (bench/tune_ray_asha.py); wall time of the whole command."""
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO / "src")}
    t0 = time.monotonic()
    proc = subprocess.run([python, str(REPO / "bench" / "tune_ray_asha.py"), str(trials), str(steps),
                           str(where / f"ray-{seed}"), str(seed)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"ray_asha failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    nan = float("nan")
    return {"wall": wall, "cpu": nan, "start": nan, "steps": nan, "held": nan, "trained": nan, "idle": nan,
            "tail": nan, "overhead": nan,
            **json.loads(proc.stdout.strip().splitlines()[-1])}


def run_way(name: str, trials: int, steps: int, seed: int, where: Path, hydra_optuna: str, ray: str) -> dict:
    if name == "ray_asha":
        return run_ray(trials, steps, seed, where, ray)
    sweep = where / f"{name}-{seed}"
    args = [sys.executable, "-m", "expgpu", "-m", *WAYS[name], *SPACE, "task=digits", f"task.max_steps={steps}",
            "task.eval_every=100", "objective=accuracy", "hydra.sweeper.direction=maximize",
            f"hydra.sweeper.n_trials={trials}", f"hydra.sweeper.sampler.seed={seed}", f"hydra.sweep.dir={sweep}",
            "~hydra.callbacks.report"]
    env = _own_env()
    if name.startswith("hydra"):
        env = with_path(env, hydra_optuna)
    if name.endswith("_1t"):
        env["OMP_NUM_THREADS"] = "1"
    t0, began, cpu0 = time.monotonic(), time.time(), _children_cpu()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return {"wall": wall, "cpu": _children_cpu() - cpu0, **_read(sweep, began)}


def _own_env() -> dict[str, str]:
    """This environment without SLURM's and expgpu's variables: each command starts as a user's would."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_"))}


def _children_cpu() -> float:
    """CPU seconds (user + system) of the ended child processes and theirs, as far as each was waited for:
    the work a way did, which other processes on a shared machine change far less than its wall time."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _read(sweep: Path, began: float) -> dict:
    jobs = [json.loads(p.read_text()) for p in sweep.glob("*/result.json")]
    trained = sorted((r["timing"]["first_step_at"], r["timing"]["first_step_at"] + r["timing"]["train_s"])
                     for r in jobs)
    gaps = []   # a trial's first step minus the latest end of training before it (the first wave has none)
    for first, _ in trained[2:]:
        before = [e for _, e in trained if e <= first]
        if before:
            gaps.append(first - max(before))
    finished = [r for r in jobs if r["status"] == "finished"]
    best = max((r["metrics"]["accuracy"] for r in finished), default=float("nan"))
    winner = max(finished, key=lambda r: r["metrics"]["accuracy"]) if finished else None
    idle, tail, first, held = _idle(sweep, trained)
    return {"start": first - began, "steps": sum(r["steps"] for r in jobs), "held": held,
            "trained": sum(e - s for s, e in trained), "best": best,
            "params": _params(Path(winner["run_dir"])) if winner else None,
            "finished": sum(r["status"] == "finished" for r in jobs),
            "pruned": sum(r["status"] == "pruned" for r in jobs), "idle": idle, "tail": tail,
            "overhead": statistics.median(gaps) if gaps else float("nan")}


def _params(job_dir: Path) -> list[str]:
    """The searched overrides a trial's job ran with (its .hydra/overrides.yaml, as Hydra saved them)."""
    from omegaconf import OmegaConf

    return [o for o in OmegaConf.load(job_dir / ".hydra" / "overrides.yaml") if o.split("=")[0] in SEARCHED]


def retrain(name: str, seed: int, params: list[str] | None, n: int, steps: int, where: Path) -> list[float]:
    """The test accuracy of a way's best trial's hyperparameters trained again with task.seed 1..n (the
    trial ran with 0): what the search found, without the luck of its one run. gpu_pool, 2 slots."""
    if not params or n < 1:
        return []
    sweep = where / f"{name}-{seed}-retrain"
    args = [sys.executable, "-m", "expgpu", "-m", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2", *params,
            "task=digits", f"task.max_steps={steps}", "task.eval_every=100", f"task.seed=range(1,{n + 1})",
            f"hydra.sweep.dir={sweep}", "~hydra.callbacks.report"]
    proc = subprocess.run(args, cwd=REPO, env=_own_env(), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"retraining {name}'s best (seed {seed}) failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return [json.loads(p.read_text())["metrics"]["accuracy"] for p in sweep.glob("*/result.json")]


def _idle(sweep: Path, trained: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    """(idle slot-time before the tail, the tail in seconds, the first trial's start, the slot-seconds held).
    Idle: 1 - the slots' occupied time / (2 slots x the span from the first trial's start to the last one's).
    Occupied: gpu_pool's jobs from their hand-over to their process's exit (pool.json); the basic launcher's
    trials, one after another in its own process, each from the end of the one before. The tail: from the last
    trial's start to the sweep's end."""
    try:
        spans = [(j["started"], j["ended"]) for j in json.loads((sweep / "pool.json").read_text())["jobs"]]
    except OSError:
        spans = [(prev_end, end) for (_, prev_end), (_, end) in zip([trained[0]] + trained, trained)]
        spans[0] = trained[0]
    t0, cut, end = min(s for s, _ in spans), max(s for s, _ in spans), max(e for _, e in spans)
    held = sum(max(0.0, min(e, cut) - s) for s, e in spans)
    return (1 - held / (2 * (cut - t0)) if cut > t0 else float("nan")), end - cut, t0, sum(e - s for s, e in spans)


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _ray_python(given: str | None) -> str | None:
    if given:
        return given
    return sys.executable if importlib.util.find_spec("ray") is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seeds", default="0,1,2", help="the sampler's seeds: each way runs once per seed")
    ap.add_argument("--only", default=",".join([*WAYS, "ray_asha"]))
    ap.add_argument("--way", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="one more way: expgpu_optuna on gpu_pool with these space-separated overrides")
    ap.add_argument("--keep", help="keep the sweep dirs here (default: a temporary dir, removed)")
    ap.add_argument("--ray-python", help="a python with ray[tune] (and torch 2.13, optuna, scikit-learn)")
    ap.add_argument("--retrain", type=int, default=5, metavar="N",
                    help="train each way's best hyperparameters again with N other task seeds (0: not)")
    a = ap.parse_args()
    ways, seeds, ray = a.only.split(","), [int(x) for x in a.seeds.split(",")], _ray_python(a.ray_python)
    for spec in a.way:
        name, _, overrides = spec.partition("=")
        WAYS[name] = [*WAYS["expgpu"], *overrides.split()]
        if name not in ways:   # named in --only too: still once
            ways.append(name)
    if "ray_asha" in ways and ray is None:
        print("ray_asha: skipped (no ray: give --ray-python, a venv's python with ray[tune])")
        ways.remove("ray_asha")
    hydra_optuna = str(install())
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory(prefix="bench_tune_") as tmp:
        where = Path(a.keep or tmp)
        where.mkdir(parents=True, exist_ok=True)
        if a.keep and any((where / f"{name}-{seed}").exists() for name in ways for seed in seeds):
            sys.exit(f"--keep {a.keep}: holds sweeps of an earlier run, which expgpu_optuna would continue "
                     "(a rerun into a sweep dir continues its study): give a new dir")
        for seed in seeds:   # seeds outside, ways inside: each seed's ways under about the same load
            for name in ways:
                r = run_way(name, a.trials, a.steps, seed, where, hydra_optuna, ray)
                runs[name].append(r)
                print(f"  seed {seed} {name:14s} wall {r['wall']:6.1f} s  cpu {r['cpu']:6.1f} s  start "
                      f"{r['start']:4.1f} s  steps {r['steps']:6.0f}  best "
                      f"{r['best']:.4f}  finished {r['finished']:2d}  pruned {r['pruned']:2d}  tail "
                      f"{r['tail']:4.1f} s  slot-s held {r['held']:5.1f} (training {r['trained']:5.1f})", flush=True)
        for name in ways:   # after the timed runs, so that they do not share the machine with these
            for seed, r in zip(seeds, runs[name]):
                accuracy = retrain(name, seed, r.pop("params"), a.retrain, a.steps, where)
                r["found"] = statistics.mean(accuracy) if accuracy else float("nan")
                if accuracy:
                    print(f"  seed {seed} {name:14s} its best's hyperparameters trained with task.seed 1-{a.retrain}: "
                          f"accuracy {r['found']:.4f} (mean; {min(accuracy):.4f}-{max(accuracy):.4f})", flush=True)
    out = {}
    for name in ways:
        out[name] = r = _median(runs[name])
        bests = " ".join(f"{x['best']:.4f}" for x in runs[name])
        print(f"{name:14s} wall {r['wall']:6.1f} s  start {r['start']:4.1f} s  best accuracy {r['best']:.4f} "
              f"({bests})  finished {r['finished']:4.1f}  pruned {r['pruned']:4.1f}  idle before the tail "
              f"{100 * r['idle']:5.1f} %  tail {r['tail']:5.1f} s  overhead {r['overhead']:.3f} s  best's "
              f"hyperparameters trained again {r['found']:.4f}   "
              f"[medians over seeds {a.seeds}]", flush=True)
    _goals(out, runs)


def _interval(pruned: list[dict], base: list[dict], rounds: int = 2000) -> tuple[tuple, tuple]:
    """90 % bootstrap intervals over the seeds (resampled with replacement, each seed's two runs kept together)
    of the wall ratio of medians and of the median best's difference in points: how far which seeds ran
    moves the two figures the goal reads."""
    import random

    rng, pairs = random.Random(0), list(zip(pruned, base))
    walls, points = [], []
    for _ in range(rounds):
        pick = [rng.choice(pairs) for _ in pairs]
        walls.append(statistics.median(p["wall"] for p, _ in pick) / statistics.median(b["wall"] for _, b in pick))
        points.append(100 * (statistics.median(p["best"] for p, _ in pick)
                             - statistics.median(b["best"] for _, b in pick)))

    def ends(xs: list[float]) -> tuple[float, float]:
        cuts = statistics.quantiles(xs, n=20)   # the 5th and the 95th percentile
        return cuts[0], cuts[-1]

    return ends(walls), ends(points)


def _goals(out: dict[str, dict], runs: dict[str, list[dict]]) -> None:
    pruned_ways = [n for n in out if n not in ("hydra_basic", "hydra_basic_1t", "hydra_pool", "expgpu", "ray_asha")]
    for pruned in pruned_ways:
        p = out[pruned]
        for base, wall_goal in (("hydra_basic", None), ("hydra_basic_1t", None), ("hydra_pool", 0.4),
                                ("ray_asha", None)):
            if base in out:
                b = out[base]
                points = 100 * (p["best"] - b["best"])
                per_seed = [x["wall"] / y["wall"] for x, y in zip(runs[pruned], runs[base])]
                cpu = [x["cpu"] / y["cpu"] for x, y in zip(runs[pruned], runs[base])]
                print(f"{pruned} / {base}: wall {p['wall'] / b['wall']:.3f}"
                      + (f" (goal <= {wall_goal})" if wall_goal else "")
                      + f" (per seed {' '.join(f'{x:.2f}' for x in per_seed)}, median "
                        f"{statistics.median(per_seed):.2f}; cpu time {' '.join(f'{x:.2f}' for x in cpu)})"
                      + f", median best accuracy {points:+.2f} points" + (" (goal >= -0.5)" if wall_goal else "")
                      + f" (the best's hyperparameters trained again: {100 * (p['found'] - b['found']):+.2f})"
                      + (f": goal {'met' if points >= -0.5 and p['wall'] / b['wall'] <= wall_goal else 'NOT met'}"
                         if wall_goal else ""))
                if wall_goal and len(runs[pruned]) >= 3:
                    (w_lo, w_hi), (p_lo, p_hi) = _interval(runs[pruned], runs[base])
                    print(f"  90 % bootstrap interval over the seeds: wall {w_lo:.3f}-{w_hi:.3f}, median best "
                          f"{p_lo:+.2f} to {p_hi:+.2f} points")
    for name in ("expgpu", *pruned_ways):
        if name in out:
            print(f"{name}: idle before the tail {100 * out[name]['idle']:.1f} % (goal < 5 %), tail "
                  f"{out[name]['tail']:.1f} s, overhead {out[name]['overhead']:.3f} s (goal <= 0.3 s)")


if __name__ == "__main__":
    main()
