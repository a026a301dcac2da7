"""What being stoppable costs: the ranks' stop poll, and the time from a signal to a saved exit.

2 ranks, gloo, CPU, task a. Runs alternate between the configurations so that machine noise
hits all alike; medians are compared.

    python bench/bench_stop_resume.py [--rounds 3] [--steps 3000]

steps/s ratio  = checkpoint.poll_every=P / poll_every=steps (never polls)   (goal >= 0.98 at the
                 default, auto: ~0.2 s of steps; 10 and 1 for comparison)
stop-to-exit   = seconds from SIGTERM (sent once training runs) to the exit of `python -m expgpu`
                 with the checkpoint saved, against SLURM's default KillWait of 30 s (goal <= 0.1)
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import pythonpath

REPO = Path(__file__).resolve().parents[1]
KILL_WAIT_S = 30.0  # slurm.conf's default: SIGTERM, then SIGKILL this much later


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    e["CUDA_VISIBLE_DEVICES"] = ""   # the CPU benchmark it says it is, on a GPU node too
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(REPO / "src"))
    return e


def cmd(run_dir: Path, steps: int, poll) -> list[str]:
    return [sys.executable, "-m", "expgpu", "task=a", f"task.max_steps={steps}", "launch.nproc_per_node=2",
            f"checkpoint.poll_every={poll}", "checkpoint.resume=false", f"hydra.run.dir={run_dir}"]


def speed(run_dir: Path, steps: int, poll) -> float:
    subprocess.run(cmd(run_dir, steps, poll), check=True, env=env(), cwd=REPO, capture_output=True)
    return json.loads((run_dir / "result.json").read_text())["timing"]["steps_per_s"]


def stop_to_exit(run_dir: Path, steps: int) -> float:
    proc = subprocess.Popen(cmd(run_dir, steps * 100, "auto"), env=env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    elapsed = time.monotonic() - t0
    assert code == 143 and (run_dir / "checkpoint.pt").exists(), code
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    polls = ["auto", 10, 1, args.steps]  # the default, the old default, every step, never
    rates: dict = {p: [] for p in polls}
    stops: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for p in polls:
                rates[p].append(speed(Path(tmp) / f"s{r}-{p}", args.steps, p))
            stops.append(stop_to_exit(Path(tmp) / f"stop{r}", args.steps))
    base = statistics.median(rates[args.steps])
    print(f"2 ranks, gloo, CPU, task a, {args.steps} steps, {args.rounds} rounds (medians)")
    print(f"  no stop poll          {base:8.1f} steps/s")
    for p in polls[:3]:
        m = statistics.median(rates[p])
        print(f"  poll_every={p:<4}       {m:8.1f} steps/s   ratio {m / base:.3f}")
    s = statistics.median(stops)
    print(f"  SIGTERM -> saved exit {s:8.2f} s         ratio to KillWait {KILL_WAIT_S:.0f} s: {s / KILL_WAIT_S:.3f}")


if __name__ == "__main__":
    main()
