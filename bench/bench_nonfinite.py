"""What task.on_nonfinite=stop saves a sweep whose learning rates partly diverge, against the default (the
diverged jobs train to their end, as a plain loop would), in the same run.

A gpu_pool sweep of `digits` on 2 CPU slots: `--jobs` jobs, every other one at lr 1e36 (its loss is nan from
the first logged row), the rest at 1e-3, `--steps` steps each. The two ways alternate, `--rounds` times each;
the sweeps' wall times (the whole command) are compared by their medians, and the best accuracy of each is
checked to be the same (the stop ends only the diverged jobs).

    python bench/bench_nonfinite.py [--jobs 8] [--steps 3000] [--rounds 2]
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


def sweep(where: Path, jobs: int, steps: int, on_nonfinite: str) -> tuple[float, float, int]:
    """(wall seconds, best accuracy, steps trained in all) of one sweep."""
    rates = ",".join(["1e36", "1e-3"] * (jobs // 2))
    args = [sys.executable, "-m", "expgpu", "-m", "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2",
            "task=digits", f"task.max_steps={steps}", f"task.optimizer.lr={rates}",
            f"task.on_nonfinite={on_nonfinite}", f"hydra.sweep.dir={where}"]
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO / "src"), "EXPGPU_WARM_SERVER": ""}
    t0 = time.monotonic()
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        sys.exit(f"{on_nonfinite}: exit {done.returncode}: {done.stderr[-3000:]}")
    results = [json.loads(p.read_text()) for p in where.glob("*/result.json")]
    best = max(r["metrics"].get("accuracy", 0.0) for r in results)
    return wall, best, sum(r["steps"] for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    walls: dict[str, list[float]] = {"continue": [], "stop": []}
    with tempfile.TemporaryDirectory(prefix="bench_nonfinite_") as tmp:
        for r in range(a.rounds):
            for way in walls:   # taking turns: a shared machine's load falls on both
                wall, best, trained = sweep(Path(tmp) / f"{way}-{r}", a.jobs, a.steps, way)
                walls[way].append(wall)
                print(f"  round {r} on_nonfinite={way:8s} wall {wall:6.1f} s  best accuracy {best:.4f}  "
                      f"steps trained {trained}", flush=True)
    cont, stop = statistics.median(walls["continue"]), statistics.median(walls["stop"])
    print(f"{a.jobs} jobs ({a.jobs // 2} diverging) x {a.steps} steps on 2 CPU slots: on_nonfinite=stop {stop:.1f} s "
          f"against continue {cont:.1f} s: {stop / cont:.2f}x the wall (medians of {a.rounds})")


if __name__ == "__main__":
    main()
