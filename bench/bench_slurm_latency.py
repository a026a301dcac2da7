"""Submission-to-first-step latency on SLURM: `python -m expgpu -m hydra/launcher=slurm` against a
plain `sbatch scripts/expgpu.sbatch` of the same job (task a, 2 ranks over gloo, 2 fake GPUs).

Both end in the same expgpu ranks; the launcher adds Hydra's multirun, expgpu's checks (scontrol
ping, partition), submitit's pickling and its in-job bootstrap. Runs alternate (launcher, sbatch,
sbatch, launcher, ...) so machine noise hits both alike; medians are compared.

    python bench/bench_slurm_latency.py [--rounds 5] [--steps 20]

Uses the cluster of $SLURM_CONF when set; otherwise starts scripts/slurm-local in its own
directory (/tmp/expgpu-slurm-bench, port base 7877; needs root) and stops it afterwards.

latency ratio = launcher / sbatch   (seconds from the submitting command's start to the first step)
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
BENCH_DIR = "/tmp/expgpu-slurm-bench"


def env(conf: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    e.update(OMP_NUM_THREADS="1", SLURM_CONF=conf, PATH=f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}")
    return e


def wait_job(job: str, e: dict, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "-o", "show", "job", job], env=e, capture_output=True, text=True).stdout
        state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")
        if state and state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
            return state
        time.sleep(0.2)
    raise TimeoutError(f"job {job} did not finish in {timeout:.0f} s")


def first_step(result: Path) -> float:
    return json.loads(result.read_text())["timing"]["first_step_at"]


def run_launcher(tmp: Path, n: int, steps: int, e: dict) -> float:
    sweep = tmp / f"launcher{n}"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "expgpu", "-m", "hydra/launcher=slurm", "task=a", f"task.max_steps={steps}",
                    "hydra.launcher.tasks_per_node=2", "hydra.launcher.gpus_per_node=2",
                    "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={sweep}"],
                   check=True, env=e, cwd=REPO, capture_output=True, timeout=600)
    return first_step(sweep / "0" / "result.json") - t0


def run_sbatch(tmp: Path, n: int, steps: int, e: dict) -> float:
    cwd = tmp / f"sbatch{n}"
    cwd.mkdir()
    t0 = time.time()
    job = subprocess.run(["sbatch", "--parsable", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                          str(REPO / "scripts" / "expgpu.sbatch"), "task=a", f"task.max_steps={steps}"],
                         check=True, env=e, cwd=cwd, capture_output=True, text=True).stdout.strip().split(";")[0]
    state = wait_job(job, e)
    if state != "COMPLETED":
        raise RuntimeError(f"sbatch job {job} ended {state}: {(cwd / f'slurm-{job}.out').read_text()}")
    return first_step(cwd / "outputs" / "slurm" / job / "result.json") - t0


def start_cluster() -> str:
    settings = dict(os.environ, SLURM_LOCAL_PORT_BASE="7877", SLURM_LOCAL_GPUS="4", SLURM_LOCAL_CPUS="8")
    subprocess.run(["bash", str(REPO / "scripts" / "slurm-local" / "start.sh"), BENCH_DIR], check=True,
                   env=settings, stdout=subprocess.DEVNULL)
    return f"{BENCH_DIR}/slurm.conf"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    own = not os.environ.get("SLURM_CONF")
    conf = start_cluster() if own else os.environ["SLURM_CONF"]
    e = env(conf)
    times = {"launcher": [], "sbatch": []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
            for n in range(args.rounds):
                order = ("launcher", "sbatch") if n % 2 == 0 else ("sbatch", "launcher")
                for kind in order:
                    run = run_launcher if kind == "launcher" else run_sbatch
                    times[kind].append(run(Path(tmp), n, args.steps, e))
                print(f"round {n + 1}/{args.rounds}: launcher {times['launcher'][-1]:.2f} s, "
                      f"sbatch {times['sbatch'][-1]:.2f} s", flush=True)
    finally:
        if own:
            subprocess.run(["bash", str(REPO / "scripts" / "slurm-local" / "stop.sh"), BENCH_DIR],
                           stderr=subprocess.DEVNULL)
    launcher, sbatch = statistics.median(times["launcher"]), statistics.median(times["sbatch"])
    print(f"submission -> first step, median of {args.rounds}: launcher {launcher:.2f} s, sbatch {sbatch:.2f} s")
    print(f"latency ratio launcher/sbatch = {launcher / sbatch:.2f}  (launcher adds {launcher - sbatch:+.2f} s)")


if __name__ == "__main__":
    main()
