"""How soon a hung rank is found and named: the hang watchdog against the collective's timeout.

    python bench/bench_hang.py [--rounds 2] [--collective-timeout 300] [--timeout 10] [--nproc 2]

Task a (the tests' model, expgpu's built-in loop), gloo, CPU; rank 1 stops making progress for good
at step 20 (faults.kind=hang, a stuck data loader). Each round runs the same hang three ways:

    today     launch.hang.timeout_s=null: the peers wait in their next collective until
              backend.timeout_s (--collective-timeout; 300 s is expgpu's default, NCCL's own is 10 to
              30 minutes), then fail, blaming the rank that waited
    fixed     launch.hang.timeout_s=--timeout, backend.timeout_s as today
    auto      launch.hang.timeout_s=auto (20 x the recent step time, at least the floor) with the
              default backend.timeout_s (300 s)

Times: from the injected hang (rank 1's warning line, stamped as this script reads it) to the line
that reports it, and to the launch's exit (every rank gone: the GPUs free). Goals: fixed <= its
timeout + 5 s; auto <= 60 s. Ratio = each against today, in the same round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HANG_STEP = 20


def one(args: list[str], nproc: int, run_dir: Path, limit_s: float) -> dict:
    """One launch: seconds from the hang to the report's line and to the exit, and that line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "expgpu", "task=a", f"task.max_steps={HANG_STEP * 100}",
           f"launch.nproc_per_node={nproc}", "checkpoint.resume=false", "faults.kind=hang", "faults.crash_rank=1",
           f"faults.crash_step={HANG_STEP}",
           *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    hung_at = said_at = None
    said = ""
    try:
        for line in proc.stdout:   # the ranks' lines reach it through expgpu's supervisor, as they come
            now = time.monotonic()
            if hung_at is None and "injected hang" in line:
                hung_at = now
            elif hung_at is not None and said_at is None and line.startswith("expgpu: "):
                said_at, said = now, line.strip()
        proc.wait(timeout=limit_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    ended = time.monotonic()
    if hung_at is None or said_at is None:
        raise SystemExit(f"bench_hang: the launch did not hang and report as expected (code {proc.returncode}): "
                         f"{' '.join(cmd)}")
    return {"said_s": said_at - hung_at, "exit_s": ended - hung_at, "line": said, "code": proc.returncode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--collective-timeout", type=float, default=300.0, help="backend.timeout_s of today and fixed")
    p.add_argument("--timeout", type=float, default=10.0, help="launch.hang.timeout_s of fixed")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    ways = {
        "today": ["launch.hang.timeout_s=null", f"backend.timeout_s={a.collective_timeout}"],
        "fixed": [f"launch.hang.timeout_s={a.timeout}", f"backend.timeout_s={a.collective_timeout}"],
        "auto": ["launch.hang.timeout_s=auto"],
    }
    found: dict[str, list[dict]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for way, args in ways.items():
                r = one(args, a.nproc, Path(tmp) / f"{way}{i}", limit_s=600)
                found[way].append(r)
                print(f"round {i + 1}/{a.rounds} {way:5}: reported {r['said_s']:5.1f} s after the hang, all ranks "
                      f"gone {r['exit_s']:5.1f} s, exit {r['code']}", flush=True)
    print(f"\n{a.nproc} ranks, gloo, CPU, task a; rank 1 hangs at step {HANG_STEP}; medians of {a.rounds} rounds")
    today = statistics.median(r["exit_s"] for r in found["today"])
    for way, goal in (("today", None), ("fixed", a.timeout + 5), ("auto", 60.0)):
        said = statistics.median(r["said_s"] for r in found[way])
        gone = statistics.median(r["exit_s"] for r in found[way])
        target = f" (goal <= {goal:.0f} s: {'met' if gone <= goal else 'NOT met'})" if goal else ""
        print(f"{way:5}: reported after {said:5.1f} s, every rank gone after {gone:5.1f} s = {gone / today:.3f}x "
              f"today's{target}")
    print(f"\ntoday's line: {found['today'][-1]['line'][:200]}")
    print(f"the watchdog's: {found['fixed'][-1]['line'][:300]}")


if __name__ == "__main__":
    main()
