"""expgpu against a plain PyTorch DDP script: training speed and startup overhead.

2 ranks, gloo, CPU, task a's model/data/batch. Runs alternate (expgpu, torchrun+plain,
mp.spawn+plain, expgpu, ...) so that machine noise hits all alike; medians are compared.

    python bench/bench_ddp_overhead.py [--rounds 5] [--steps 1500] [--precision bf16]

The built-in loop is expgpu's supervised task function on the Run API (run.steps, run.log);
--precision bf16 compares task.precision=bf16 with a plain torch.autocast(bfloat16) loop.

steps/s ratio  = expgpu / plain           (goal >= 0.98)
startup extra  = expgpu - plain, seconds from launch to the first training step (goal <= 0.3 s)
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


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    return e


def run_expgpu(steps: int, tmp: Path, n: int, precision: str) -> tuple[float, float]:
    run_dir = tmp / f"expgpu{n}"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "expgpu", "task=a", f"task.max_steps={steps}", "launch.nproc_per_node=2",
                    f"task.precision={precision}", f"hydra.run.dir={run_dir}", "checkpoint.resume=false"],
                   check=True, env=env(), cwd=REPO, capture_output=True)
    timing = json.loads((run_dir / "result.json").read_text())["timing"]
    return timing["first_step_at"] - t0, timing["steps_per_s"]


def run_plain(steps: int, launcher: str, port: int, precision: str) -> tuple[float, float]:
    script = [str(REPO / "bench" / "plain_ddp.py"), str(steps), "--precision", precision]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *script]
    else:
        cmd = [sys.executable, *script, "--spawn", "2"]
    e = env()
    e["MASTER_PORT"] = str(port)
    for attempt in (1, 2):  # a rendezvous port taken by another program fails a run now and then
        t0 = time.time()
        proc = subprocess.run(cmd, env=e, cwd=REPO, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        print(f"{launcher} run failed (attempt {attempt}): {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        e["MASTER_PORT"] = str(port + 1000)
    else:
        raise SystemExit(f"the plain {launcher} baseline failed twice")
    line = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    return line["first_step_at"] - t0, line["steps_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--precision", choices=["32", "bf16"], default="32")
    args = ap.parse_args()
    results = {"expgpu": [], "torchrun": [], "mp.spawn": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            results["expgpu"].append(run_expgpu(args.steps, Path(tmp), i, args.precision))
            results["torchrun"].append(run_plain(args.steps, "torchrun", 29600 + i, args.precision))
            results["mp.spawn"].append(run_plain(args.steps, "spawn", 29700 + i, args.precision))
            print(f"round {i + 1}/{args.rounds}: " + "  ".join(
                f"{k} start {v[-1][0]:.2f}s {v[-1][1]:.0f} steps/s" for k, v in results.items()), flush=True)
    med = {k: (statistics.median(s for s, _ in v), statistics.median(r for _, r in v)) for k, v in results.items()}
    print(f"\n2 ranks, gloo, CPU, task a, precision {args.precision}, {args.steps} steps, "
          f"median of {args.rounds} alternating rounds")
    for base in ("torchrun", "mp.spawn"):
        ratio = med["expgpu"][1] / med[base][1]
        extra = med["expgpu"][0] - med[base][0]
        print(f"vs plain script under {base:8s}: steps/s ratio {ratio:.3f} (goal >= 0.98), "
              f"startup {med['expgpu'][0]:.2f}s vs {med[base][0]:.2f}s: extra {extra:+.2f}s (goal <= +0.30s)")


if __name__ == "__main__":
    main()
