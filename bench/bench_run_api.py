"""The Run API's cost on the hot path: a user's loop through run.steps / run.log vs the same loop
written plainly against torch, both as task functions under the same expgpu launch (2 ranks,
gloo, CPU, task a's model and data). Runs alternate; medians are compared.

    python bench/bench_run_api.py [--rounds 7] [--steps 3000] [--nproc 2]

steps/s ratio = run.steps / plain loop     (goal >= 0.99)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def run(task: str, steps: int, nproc: int, run_dir: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{BENCH}{os.pathsep}{REPO / 'src'}")
    subprocess.run([sys.executable, "-m", "expgpu", "--config-dir", str(BENCH / "conf"), f"task={task}",
                    f"task.steps={steps}", f"launch.nproc_per_node={nproc}", "checkpoint.resume=false",
                    f"hydra.run.dir={run_dir}"], check=True, env=env, cwd=REPO, capture_output=True)
    return json.loads((run_dir / "result.json").read_text())["metrics"]["steps_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    rates: dict[str, list[float]] = {"loop_plain": [], "loop_run": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = list(rates) if i % 2 == 0 else list(reversed(rates))
            for task in order:
                rates[task].append(run(task, args.steps, args.nproc, Path(tmp) / f"{task}{i}"))
            print(f"round {i + 1}/{args.rounds}: plain {rates['loop_plain'][-1]:.0f} steps/s, "
                  f"run.steps {rates['loop_run'][-1]:.0f} steps/s", flush=True)
    plain, api = statistics.median(rates["loop_plain"]), statistics.median(rates["loop_run"])
    paired = statistics.median(r / p for r, p in zip(rates["loop_run"], rates["loop_plain"]))
    print(f"\n{args.nproc} rank(s), gloo, CPU, {args.steps} steps, median of {args.rounds} alternating rounds")
    print(f"run.steps/run.log vs the plain loop: steps/s ratio {api / plain:.3f} (medians {api:.0f} / {plain:.0f}), "
          f"median of per-round ratios {paired:.3f} (goal >= 0.99)")


if __name__ == "__main__":
    main()
