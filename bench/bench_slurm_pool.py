"""A 24-trial study of the built-in `digits` task on SLURM, on 2 slots, two ways, the same sampler and seed:

  slurm       hydra/launcher=slurm (hydra-submitit-launcher's model): one SLURM job per trial, 2 at a time
              (expgpu_optuna's n_jobs=2), each job its own queue wait, its own Python and imports
  slurm_pool  hydra/launcher=slurm_pool: one SLURM job (1 node, 2 GPUs) running the study inside with gpu_pool,
              each trial forked on its GPU by the node's warm process
  slurm_pool_cold  the same, each trial an srun step of its own (hydra.launcher.pool.warm_starts=false)

    SLURM_CONF=/path/slurm.conf python bench/bench_slurm_pool.py [--trials 24] [--steps 3000] [--seed 0] [--ways ...]

On the local cluster (scripts/slurm-local: its nodes are this machine, 4 fake GPUs; the queue is empty, so
neither way waits behind other users' jobs). Printed for each way: the whole command's wall time, the SLURM
jobs it submitted (sacct's count when accounting is on, else the submissions seen), the best accuracy, and
the median from a trial's end to the next trial's first step (result.json's timing: its queue wait, its start
and its imports). Goals (slurm_pool against slurm): wall <= 0.6x; that median <= 1 s; 1 SLURM job against 24.
On a real cluster each of slurm's jobs also waits in the queue (minutes to hours when it is busy), which
slurm_pool pays once.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPACE = ["task.optimizer.lr=tag(log, interval(1e-4, 3e-1))", "task.model.hidden=choice(16,32,64,128,256)",
         "task.batch_size=choice(8,16,32,64)"]
WAYS = {
    "slurm": ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
              "hydra.launcher.timeout_min=30", "hydra.sweeper.n_jobs=2"],
    "slurm_pool": ["hydra/launcher=slurm_pool", "hydra.launcher.nodes=1", "hydra.launcher.gpus_per_node=2",
                   "hydra.launcher.cpus_per_node=2", "hydra.launcher.timeout_min=30"],
}
# the same allocation, each trial an srun step of its own that starts a new Python (no warm node process)
WAYS["slurm_pool_cold"] = [*WAYS["slurm_pool"], "hydra.launcher.pool.warm_starts=false"]


def run(way: str, trials: int, steps: int, seed: int, where: Path) -> dict:
    sweep = where / way
    args = [sys.executable, "-m", "expgpu", "-m", "hydra/sweeper=expgpu_optuna", *WAYS[way], *SPACE, "task=digits",
            f"task.max_steps={steps}", "task.eval_every=100", "objective=accuracy", "hydra.sweeper.direction=maximize",
            f"hydra.sweeper.n_trials={trials}", f"hydra.sweeper.sampler.seed={seed}", "logger=none",
            f"hydra.sweep.dir={sweep}", "~hydra.callbacks.report"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPGPU_")}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=where, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{way} failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
    jobs = [json.loads(p.read_text()) for p in sweep.glob("*/result.json")]
    trained = sorted((r["timing"]["first_step_at"], r["timing"]["first_step_at"] + r["timing"]["train_s"])
                     for r in jobs)
    gaps = [first - max(e for _, e in trained if e <= first) for first, _ in trained[2:]
            if any(e <= first for _, e in trained)]
    if way == "slurm":
        submitted = len([p for p in (sweep / ".submitit").iterdir() if p.is_dir()])
    else:
        submitted = len(list((sweep / ".slurm_pool").glob("allocation-*.out")))
    assert ("waiting for the warm processes" in proc.stdout) == (way == "slurm_pool"), proc.stdout[-2000:]
    return {"wall": wall, "jobs": submitted, "trials": len(jobs),
            "best": max((r["metrics"]["accuracy"] for r in jobs if r["status"] == "finished"), default=float("nan")),
            "gap": statistics.median(gaps) if gaps else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ways", default=",".join(WAYS), help="which of " + ", ".join(WAYS) + " (slurm and slurm_pool "
                                                            "for the ratio)")
    a = p.parse_args()
    if not os.environ.get("SLURM_CONF"):
        sys.exit("bench_slurm_pool: set SLURM_CONF to a cluster's slurm.conf (scripts/slurm-local/start.sh)")
    got = {}
    with tempfile.TemporaryDirectory() as d:
        for way in a.ways.split(","):
            got[way] = r = run(way, a.trials, a.steps, a.seed, Path(d))
            print(f"{way:10}: {r['wall']:6.1f} s, {r['jobs']} SLURM job(s), {r['trials']} trials, best accuracy "
                  f"{r['best']:.4f}, a trial's end to the next one's first step {r['gap']:.2f} s (median)", flush=True)
    if "slurm" not in got or "slurm_pool" not in got:
        return
    s, p_ = got["slurm"], got["slurm_pool"]
    print(f"\nslurm_pool / slurm: wall {p_['wall'] / s['wall']:.3f}x (goal <= 0.6); end-to-next-first-step "
          f"{p_['gap']:.2f} s against {s['gap']:.2f} s (goal <= 1 s); SLURM jobs {p_['jobs']} against {s['jobs']}")
    if "slurm_pool_cold" in got:
        c = got["slurm_pool_cold"]
        print(f"warm node processes / srun steps: wall {p_['wall'] / c['wall']:.3f}x, end-to-next-first-step "
              f"{p_['gap']:.2f} s against {c['gap']:.2f} s")


if __name__ == "__main__":
    main()
