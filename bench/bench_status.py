"""`expgpu status` over 1,000 run dirs: how long a user waits for the table (goal < 1 s).

    python bench/bench_status.py [--runs 950] [--sweeps 5] [--jobs 10] [--rows 2000] [--rounds 5] [--keep DIR]

Builds, in a temp dir, `--runs` run dirs under outputs/DATE/TIME and `--sweeps` gpu_pool sweeps of `--jobs` jobs
each (1,000 run dirs in all by default), each as a real run leaves it: .hydra/ (config.yaml, hydra.yaml,
overrides.yaml), .expgpu/process.json, logs/, a metrics.jsonl of `--rows` rows with the progress fields, and,
for most, result.json (a real one's keys and size); a tenth still running (this process is their pid), a tenth
lost. Then times, `--rounds` times each (the median and the slowest):

    process    `python -m expgpu.status DIR` as a user starts it: the interpreter, the imports, the table
    in-process expgpu.status.rows(DIR) and the table, in this process (files in the page cache, as after the
               first look)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import pythonpath

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 1.0


def result_doc(run_dir: Path, steps: int, status: str) -> dict:
    plan = [{"rank": 0, "host": "node", "device": "cuda:0", "gpus": [0], "names": ["NVIDIA H100"],
             "param_checksum": "ab" * 16}]
    return {"status": status, "task": "a", "function": "expgpu.tasks.supervised:train",
            "task_config": {"name": "a", "max_steps": steps, "lr": 0.001, "batch_size": 64, "seed": 0},
            "source": "single", "world_size": 1, "backend": None, "strategy": "ranked", "plan": plan,
            "metrics": {"final_loss": 0.1465, "accuracy": 0.91}, "steps": steps, "max_steps": steps,
            "length_keys": ["max_steps"], "stop_signal": None,
            "timing": {"startup_s": 3.2, "train_s": 120.5, "steps_per_s": 16.6}, "run_dir": str(run_dir),
            "epochs": 3, "step_means": [0.5] * 10, "resumed_from_step": None, "param_checksum": "ab" * 16,
            "rank_checksums": ["ab" * 16], "attempts": [{"attempt": 1, "kind": status}], "excluded_nodes": []}


def make_run(run_dir: Path, n: int, rows: int, now: float) -> None:
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".expgpu").mkdir()
    (run_dir / "logs").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("task:\n  name: a\n  max_steps: 2000\n" * 20)
    (run_dir / ".hydra" / "hydra.yaml").write_text("hydra:\n  run:\n    dir: x\n" * 60)
    (run_dir / ".hydra" / "overrides.yaml").write_text(f"- task=a\n- task.seed={n}\n")
    (run_dir / "logs" / "rank0.log").write_text("step 1\n" * 200)
    kind = n % 10   # 0: running (this process), 1: lost (a pid that is gone), else finished
    steps = rows if kind > 1 else rows // 2
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "loss": 1.0 / s, "lr": 0.001, "epoch": s // 700, "time": now - steps + s,
                                "max_steps": rows, "epochs": 3, "steps_per_s": 16.6, "eta_s": rows - s}) + "\n")
    import psutil

    me = psutil.Process()
    record = {"pid": me.pid if kind == 0 else 2 ** 22 + n, "host": os.uname().nodename, "created": me.create_time(),
              "started": now - 3600 + n, "job": None, "visible": "0"}
    (run_dir / ".expgpu" / "process.json").write_text(json.dumps(record))
    if kind > 1:
        (run_dir / "result.json").write_text(json.dumps(result_doc(run_dir, steps, "finished"), indent=2))


def build(top: Path, runs: int, sweeps: int, jobs: int, rows: int) -> int:
    now = time.time()
    made = 0
    for n in range(runs):
        make_run(top / "outputs" / f"2025-01-{1 + n // 100:02d}" / f"{n % 100:02d}-00-00", n, rows, now)
        made += 1
    for s in range(sweeps):
        sweep = top / "outputs" / "multirun" / "2025-02-01" / f"{s:02d}-00-00"
        pool = []
        for j in range(jobs):
            make_run(sweep / str(j), runs + s * jobs + j, rows, now)
            pool.append({"num": j, "dir": str(sweep / str(j)), "state": "finished", "gpus": [j % 8], "slot": None})
            made += 1
        (sweep / "multirun.yaml").write_text("hydra: {}\n")
        (sweep / "pool.json").write_text(json.dumps({"jobs": pool}))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=950)
    parser.add_argument("--sweeps", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--rows", type=int, default=2000, help="metrics.jsonl rows of a finished run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="build here and keep it (default: a temp dir, removed)")
    args = parser.parse_args()
    top = args.keep or Path(tempfile.mkdtemp(prefix="expgpu-bench-status-"))
    sys.path.insert(0, str(REPO / "src"))
    try:
        t0 = time.perf_counter()
        made = build(top, args.runs, args.sweeps, args.jobs, args.rows)
        print(f"built {made} run dirs ({args.sweeps} sweeps) in {time.perf_counter() - t0:.1f} s: {top}")
        env = {**os.environ, "PYTHONPATH": pythonpath(REPO / "src")}
        process = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "expgpu.status", str(top / "outputs")], env=env,
                                  capture_output=True, text=True)
            process.append(time.perf_counter() - t)
            if done.returncode != 0:
                sys.exit(f"expgpu.status failed: {done.stderr}")
        lines = done.stdout.count("\n")
        from expgpu.status import rows, table

        inside = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            shown = rows((top / "outputs").resolve())
            table(shown)
            inside.append(time.perf_counter() - t)
        counts = {}
        for r in shown:
            counts[r.status] = counts.get(r.status, 0) + 1
        print(f"table: {lines} lines, {len(shown)} rows ({', '.join(f'{v} {k}' for k, v in counts.items())})")
        for name, times in (("process", process), ("in-process", inside)):
            median = statistics.median(times)
            print(f"{name:11s} median {median:.3f} s, slowest {max(times):.3f} s over {args.rounds} rounds   "
                  f"goal < {GOAL_S:.0f} s: {'met' if max(times) < GOAL_S else 'MISSED'}")
    finally:
        if args.keep is None:
            shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
