"""hydra.launcher.jobs_per_gpu on one GPU: a sweep of small training jobs, one job on the GPU at a time against
several at once, alternating, in the same run (the baseline: jobs_per_gpu=1, the pool without sharing).

    python bench/bench_gpu_sharing.py                       # on a GPU node: GPU 0, 16 jobs of task a
    python bench/bench_gpu_sharing.py --jobs 8 --shares 1,2,4 --rounds 2 --steps 1500
    python bench/bench_gpu_sharing.py --simulate --jobs 4 --steps 50 --rounds 1   # the bench itself, on a CPU

Each job trains task a (a small MLP: what a search's trials often are) for --steps steps on the GPU; its
process starts CUDA, trains, saves and exits, as a sweep's job does. A small model leaves a big GPU idle
most of each step, and each job's start (CUDA's context, the first kernels) is time the GPU does nothing:
sharing the GPU overlaps them.

makespan = the whole sweep command, Hydra's start included; the median of --rounds per setting
ratio    = makespan with jobs_per_gpu=K / makespan with jobs_per_gpu=1  (below 1: sharing pays)
With --simulate the "GPU" is a simulated one and the jobs train on the CPU: the ratio then says nothing
about a GPU (the CPU's cores are shared instead); it only shows the bench runs.
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

from paths import pythonpath

REPO = Path(__file__).resolve().parents[1]


def sweep(k: int, args, tmp: Path, n: int) -> float:
    sweep_dir = tmp / f"k{k}-{n}"
    cmd = [sys.executable, "-m", "expgpu", "-m", "hydra/launcher=gpu_pool", "task=a", f"task.max_steps={args.steps}",
           f"task.seed=range({args.jobs})", f"hydra.launcher.jobs_per_gpu={k}", "hydra.launcher.gpus=[0]",
           "logger=none", f"hydra.sweep.dir={sweep_dir}", f"hydra.launcher.lease_dir={tmp / 'leases'}"]
    if args.simulate:
        cmd.append("inventory.simulate=[{name:H100,memory_mb:81559}]")
    env = {k_: v for k_, v in os.environ.items() if not k_.startswith(("SLURM_", "EXPGPU_"))}
    env["PYTHONPATH"] = pythonpath(REPO / "src")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"jobs_per_gpu={k} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    pool = json.loads((sweep_dir / "pool.json").read_text())
    assert all(j["state"] == "finished" for j in pool["jobs"]), pool
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--shares", default="1,4", help="jobs_per_gpu values; the first is the baseline")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--simulate", action="store_true", help="a simulated GPU, jobs on the CPU (the bench only)")
    args = p.parse_args()
    shares = [int(k) for k in args.shares.split(",")]
    took: dict[int, list[float]] = {k: [] for k in shares}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.rounds):
            for k in shares:   # alternating: machine noise hits every setting alike
                took[k].append(sweep(k, args, Path(tmp), n))
                print(f"round {n + 1}/{args.rounds}: jobs_per_gpu={k}: {took[k][-1]:.1f} s", flush=True)
    base = statistics.median(took[shares[0]])
    where = "a simulated GPU (jobs on the CPU)" if args.simulate else "GPU 0"
    print(f"\n{args.jobs} jobs of task a, {args.steps} steps each, on {where}; median of {args.rounds} round(s)")
    for k in shares:
        m = statistics.median(took[k])
        print(f"jobs_per_gpu={k}: makespan {m:.1f} s, ratio {m / base:.2f} against jobs_per_gpu={shares[0]}")


if __name__ == "__main__":
    main()
