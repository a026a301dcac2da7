"""gpu_pool's makespan for a sweep of jobs of known durations, against the ideal and Hydra's basic launcher;
with --cpu, CPU-bound training jobs against the basic launcher, and a pool job's start-to-first-step.

The jobs sleep (a tiny Hydra app written to a temp dir, no torch): what is measured is the launcher,
its per-job process start-up and how fast it refills a free slot, not the training. Three launchers
run the same sweep, alternating (basic, pool on CPU slots, pool on leased simulated GPUs, basic, ...)
so machine noise hits all alike; medians are compared.

    python bench/bench_pool_makespan.py [--slots 4] [--rounds 2] [--scale 1.0]

makespan   = first job start to last job end, as the jobs themselves recorded it; for the pool it
             includes each job's process start-up (the launcher's first Popen to the last exit).
ideal      = max(total duration / slots, longest job)              (the pool's goal: <= 1.05 x ideal)
end-to-end = the whole command, Hydra's own start-up included

    python bench/bench_pool_makespan.py --eight          # 8 jobs of 2 s on 4 simulated GPUs (ideal 4 s), and
                                                         # the hand-over: a job handed out (pool.json started) to
                                                         # its task code; a job's end to the next on its GPUs
    python bench/bench_pool_makespan.py --cpu [--before DIR/src]
    python bench/bench_pool_makespan.py --eight --report live    # with expgpu's sweep report (live: rewritten
                                                                 # as jobs end; final: at the end only)

--cpu: 6 jobs of task a (400 steps, CPU-bound), basic launcher vs hydra/launcher=gpu_pool
hydra.launcher.cpu_slots=2, no OMP_NUM_THREADS set (the pool's thread budget decides); the whole
command's wall time is compared (goal: pool <= basic / 1.1). basic_1t: the basic launcher with
OMP_NUM_THREADS=1, a baseline that other processes on the machine slow down less (torch's OpenMP
threads on every core collapse when another process takes one). startup = a pool job's start-to-first-step
(result.json timing.startup_s: from its hand-over to a process to its first training step), median of
the jobs after the first wave (those get a spare that warmed up while others ran; goal <= 0.3 s).
--before SRC runs the same pool sweep on another checkout's src/ too (e.g. the commit before a change),
alternating with this one, for a before/after figure in one run.
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

APP = '''
import json, time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import hydra
from hydra.core.config_store import ConfigStore


@dataclass
class Inventory:
    simulate: Optional[List[Any]] = None   # read by gpu_pool: the simulated GPUs it leases


@dataclass
class Bench:
    job: int = 0
    durations: List[float] = field(default_factory=list)
    log: str = ""
    inventory: Inventory = field(default_factory=Inventory)


ConfigStore.instance().store(name="bench", node=Bench)


@hydra.main(version_base="1.3", config_path=None, config_name="bench")
def main(cfg) -> int:
    t0 = time.time()
    time.sleep(cfg.durations[cfg.job])
    with open(cfg.log, "a") as f:
        f.write(json.dumps({"job": cfg.job, "t0": t0, "t1": time.time()}) + "\\n")
    return cfg.job


if __name__ == "__main__":
    main()
'''


def env(src: Path = REPO / "src", threads: bool = True) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_")) and k != "CUDA_VISIBLE_DEVICES"
         and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    e["PYTHONPATH"] = pythonpath(src)
    if threads:
        e["OMP_NUM_THREADS"] = "1"
    return e


REPORT = "none"   # --report: the sweep report callback in the bench's app (none, final, live)


def run(kind: str, durations: list[float], slots: int, tmp: Path, n: int) -> tuple[float, float]:
    """(makespan, end-to-end) seconds of one sweep with launcher `kind`."""
    log = tmp / f"{kind}{n}.jsonl"
    args = [sys.executable, str(tmp / "app.py"), "-m", f"job=range({len(durations)})",
            f"durations=[{','.join(map(str, durations))}]", f"log={log}", f"hydra.sweep.dir={tmp / f'{kind}{n}'}"]
    if REPORT != "none":
        args += ["+hydra.callbacks.report._target_=expgpu.report.callback.SweepReport",
                 f"+hydra.callbacks.report.live={REPORT == 'live'}", "+hydra.callbacks.report.refresh_s=1"]
    if kind == "pool_cpu":
        args += ["hydra/launcher=gpu_pool", f"hydra.launcher.cpu_slots={slots}"]
    elif kind == "pool_gpu":
        sim = ",".join(["{name:A100,memory_mb:40960}"] * slots)
        args += ["hydra/launcher=gpu_pool", f"inventory.simulate=[{sim}]", f"hydra.launcher.lease_dir={tmp / 'leases'}"]
    t0 = time.time()
    done = subprocess.run(args, env=env(), cwd=tmp, capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode != 0:
        sys.exit(f"{kind} sweep failed:\n{done.stderr[-3000:]}")
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(recs) == len(durations), f"{kind}: {len(recs)} of {len(durations)} jobs ran"
    if kind == "basic":
        return max(r["t1"] for r in recs) - min(r["t0"] for r in recs), wall
    jobs = json.loads((tmp / f"{kind}{n}" / "pool.json").read_text())["jobs"]
    return max(j["ended"] for j in jobs) - min(j["started"] for j in jobs), wall


def handovers(kind: str, tmp: Path, n: int) -> tuple[list[float], list[float]]:
    """(hand-outs, refills): each job's hand-out, from pool.json's `started` (its GPUs leased, the job handed to
    a process) to its task's code (the app's own t0); each refill of a GPU, from a job's own end (its t1) to
    the task's code of the next job on the same GPUs: the reaping, the leasing, the hand-out and the start."""
    times = {r["job"]: r for r in map(json.loads, (tmp / f"{kind}{n}.jsonl").read_text().splitlines())}
    jobs = json.loads((tmp / f"{kind}{n}" / "pool.json").read_text())["jobs"]
    out = [times[j["num"]]["t0"] - j["started"] for j in sorted(jobs, key=lambda j: j["started"])]
    by_gpus: dict[tuple, list[dict]] = {}
    for j in jobs:
        by_gpus.setdefault(tuple(j["gpus"]), []).append(times[j["num"]])
    refills = []
    for runs in by_gpus.values():
        runs.sort(key=lambda r: r["t0"])
        refills += [b["t0"] - a["t1"] for a, b in zip(runs, runs[1:])]
    return out, sorted(refills)


def run_cpu(kind: str, tmp: Path, n: int, jobs: int, steps: int, slots: int, src: Path) -> dict:
    """One sweep of `jobs` task-a trainings: the command's wall time, the pool's makespan, and each
    job's start-to-first-step."""
    sweep = tmp / f"cpu-{kind}{n}"
    args = [sys.executable, "-m", "expgpu", "-m", "task=a", f"task.max_steps={steps}",
            f"task.seed=range({jobs})", "checkpoint.resume=false", f"hydra.sweep.dir={sweep}"]
    if not kind.startswith("basic"):
        args += ["hydra/launcher=gpu_pool", f"hydra.launcher.cpu_slots={slots}"]
    t0 = time.time()
    done = subprocess.run(args, env=env(src, threads=kind == "basic_1t"), cwd=tmp, capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode != 0:
        sys.exit(f"{kind} sweep failed:\n{done.stderr[-3000:]}")
    out = {"wall": wall, "span": None, "startup": []}
    if not kind.startswith("basic"):
        rows = json.loads((sweep / "pool.json").read_text())["jobs"]
        out["span"] = max(j["ended"] for j in rows) - min(j["started"] for j in rows)
        late = sorted(rows, key=lambda j: j["started"])[slots:]   # after the first wave: warm spares
        out["startup"] = [json.loads((Path(j["dir"]) / "result.json").read_text())["timing"]["startup_s"]
                          for j in late]
    return out


def cpu_main(args) -> None:
    kinds = ["basic", "basic_1t", "pool"] + (["pool_before"] if args.before else [])
    srcs = {"basic": REPO / "src", "basic_1t": REPO / "src", "pool": REPO / "src",
            "pool_before": Path(args.before or ".")}
    res: dict[str, list[dict]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as d:
        for n in range(args.rounds):
            for kind in kinds:
                r = run_cpu(kind, Path(d), n, args.jobs, args.steps, 2, srcs[kind])
                res[kind].append(r)
                st = f" startup median {statistics.median(r['startup']):.3f}s" if r["startup"] else ""
                print(f"  round {n}: {kind:11s} end-to-end {r['wall']:6.2f}s" + st, flush=True)
    med = {k: statistics.median(r["wall"] for r in res[k]) for k in kinds}
    print(f"\n{args.jobs} jobs of task a ({args.steps} steps), 2 CPU slots, {os.cpu_count()} cores, "
          f"no OMP_NUM_THREADS (median of {args.rounds} rounds)")
    print(f"{'launcher':12s} {'end-to-end':>11s} {'x basic':>8s} {'startup (warm spare)':>21s}")
    for k in kinds:
        ups = [u for r in res[k] for u in r["startup"]]
        up = f"{statistics.median(ups):.3f}s (max {max(ups):.3f})" if ups else "-"
        print(f"{k:12s} {med[k]:10.2f}s {med[k] / med['basic']:8.3f} {up:>21s}")
    print(f"\ngpu_pool / basic = {med['pool'] / med['basic']:.3f} (goal <= {1 / 1.1:.3f})")


def eight_main(args) -> None:
    """8 jobs of 2 s on 4 simulated GPUs: the pool's makespan against the ideal 4 s."""
    spans, outs, refills = [], [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "app.py").write_text(APP)
        for n in range(args.rounds):
            span, wall = run("pool_gpu", [2.0] * 8, 4, tmp, n)
            spans.append(span)
            out, refill = handovers("pool_gpu", tmp, n)
            outs += out
            refills += refill
            print(f"  round {n}: makespan {span:6.3f}s  end-to-end {wall:6.2f}s  hand-out to task code "
                  f"{' '.join(f'{h:.3f}' for h in out)} s; a GPU's refill {' '.join(f'{h:.3f}' for h in refill)} s",
                  flush=True)
    m = statistics.median(spans)
    print(f"\n8 jobs of 2 s, 4 simulated GPUs: makespan median {m:.3f}s (max {max(spans):.3f}s), "
          f"x ideal 4 s = {m / 4:.3f} (goal <= 1.05)")
    for what, xs in (("a job's hand-out to its task's code", outs),
                     ("a job's end to the next job's task code on its GPUs", refills)):
        h = statistics.median(xs)
        print(f"{what}: median {h:.3f}s (max {max(xs):.3f}s) (goal <= 0.1 s: {'met' if h <= 0.1 else 'NOT met'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every job duration by this")
    ap.add_argument("--eight", action="store_true", help="8 jobs of 2 s on 4 simulated GPUs")
    ap.add_argument("--cpu", action="store_true", help="CPU-bound task-a jobs: pool vs basic, startup")
    ap.add_argument("--jobs", type=int, default=6, help="--cpu: jobs in the sweep")
    ap.add_argument("--steps", type=int, default=400, help="--cpu: steps per job")
    ap.add_argument("--before", help="--cpu: another checkout's src/ to run the pool sweep on too")
    ap.add_argument("--report", choices=("none", "final", "live"), default="none",
                    help="expgpu's sweep report in the app: none, at the end only, or live (rewritten as jobs end, "
                         "at most every second here)")
    args = ap.parse_args()
    global REPORT
    REPORT = args.report
    if args.cpu:
        return cpu_main(args)
    if args.eight:
        return eight_main(args)
    # Four waves of `slots` jobs, longest first: a schedule in sweep order can reach the ideal.
    base = [5.0] * args.slots + [3.0] * args.slots + [2.0] * args.slots + [1.0] * args.slots
    durations = [round(d * args.scale, 3) for d in base]
    ideal = max(sum(durations) / args.slots, max(durations))
    kinds = ("basic", "pool_cpu", "pool_gpu")
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "app.py").write_text(APP)
        for n in range(args.rounds):
            for kind in kinds:
                results[kind].append(run(kind, durations, args.slots, tmp, n))
                span, wall = results[kind][-1]
                print(f"  round {n}: {kind:8s} makespan {span:6.2f}s  end-to-end {wall:6.2f}s", flush=True)
    basic_span = statistics.median(s for s, _ in results["basic"])
    basic_wall = statistics.median(w for _, w in results["basic"])
    print(f"\n{len(durations)} jobs, {sum(durations):g}s of work, {args.slots} slots: ideal makespan {ideal:g}s "
          f"(median of {args.rounds} rounds)")
    print(f"{'launcher':10s} {'makespan':>9s} {'x ideal':>8s} {'x basic':>8s} {'end-to-end':>11s} {'x basic':>8s}")
    for kind in kinds:
        span = statistics.median(s for s, _ in results[kind])
        wall = statistics.median(w for _, w in results[kind])
        print(f"{kind:10s} {span:8.2f}s {span / ideal:8.3f} {span / basic_span:8.3f} {wall:10.2f}s "
              f"{wall / basic_wall:8.3f}")
    pool = max(statistics.median(s for s, _ in results[k]) for k in ("pool_cpu", "pool_gpu"))
    print(f"\npool makespan / ideal = {pool / ideal:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
