"""expgpu against a plain PyTorch DDP script: training speed and startup overhead.

2 ranks, gloo, CPU, task a's model/data/batch.

    python bench/bench_ddp_overhead.py [--rounds 5] [--steps 6000] [--precision bf16] [--control]
                                       [--launches 3] [--launch-steps 1500]

Training speed, interleaved: in each of --rounds launches, expgpu's built-in loop (the supervised
task function on the Run API) and the plain DDP loop of bench/plain_ddp.py run in the same
processes, taking turns every 50 steps (user_loops.builtin_interleaved), so that machine noise
hits both alike; separate launches of the two differ by 10-40 % on a shared 2-core machine.
--precision bf16 compares task.precision=bf16 with a plain torch.autocast(bfloat16) loop.
--control adds an A/A launch per round (a plain loop against a plain loop): the noise floor.

Startup, separate launches: expgpu, torchrun + the plain script, mp.spawn + the plain script,
alternating, --launches times each; medians are compared (their steps/s are printed too).
--nproc 1: expgpu against the plain script run alone (one process, no process group, no DDP).
--gpu: on a GPU node, both on the GPUs (expgpu's default gpu_map, backend auto; the plain script on
cuda:LOCAL_RANK over nccl): what CUDA's start costs each. For the start-up only: use --rounds 0.

    python bench/bench_ddp_overhead.py --gpu --nproc 1 --rounds 0 --launches 5

--workers N: N DataLoader workers a rank (expgpu: data.num_workers=N; the plain loop keeps its workers for
the whole run, persistent_workers=True). Interleaved, each of the two loops has its own N; the separate
launches run the plain script once more with PyTorch's default, its workers started again each epoch
("+fresh"): what each epoch's new workers cost.

    python bench/bench_ddp_overhead.py --nproc 1 --rounds 0 --workers 2

steps/s ratio  = built-in loop / plain loop, interleaved     (goal >= 0.98)
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

from paths import pythonpath

REPO = Path(__file__).resolve().parents[1]


BENCH = REPO / "bench"


def env(gpu: bool = False) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    if not gpu:
        e["CUDA_VISIBLE_DEVICES"] = ""   # the CPU benchmark it says it is, on a GPU node too
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(BENCH, REPO / "src"))
    return e


def run_interleaved(task: str, args: list[str], run_dir: Path) -> dict:
    subprocess.run([sys.executable, "-m", "expgpu", "--config-dir", str(BENCH / "conf"), f"task={task}", *args,
                    "launch.nproc_per_node=2", "checkpoint.resume=false", f"hydra.run.dir={run_dir}"],
                   check=True, env=env(), cwd=REPO, capture_output=True)
    return json.loads((run_dir / "result.json").read_text())["metrics"]


def run_expgpu(steps: int, tmp: Path, n: int, args) -> tuple[float, float]:
    run_dir = tmp / f"expgpu{n}"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "expgpu", "task=a", f"task.max_steps={steps}",
                    f"launch.nproc_per_node={args.nproc}", f"task.precision={args.precision}",
                    f"data.num_workers={args.workers}",
                    f"hydra.run.dir={run_dir}", "checkpoint.resume=false"],
                   check=True, env=env(args.gpu), cwd=REPO, capture_output=True)
    timing = json.loads((run_dir / "result.json").read_text())["timing"]
    return timing["first_step_at"] - t0, timing["steps_per_s"]


def run_plain(steps: int, launcher: str, port: int, args) -> tuple[float, float]:
    """launcher: torchrun, mp.spawn or python, with "+fresh": the script's workers started again each epoch."""
    launcher, fresh = launcher.removesuffix("+fresh"), launcher.endswith("+fresh")
    script = [str(REPO / "bench" / "plain_ddp.py"), str(steps), "--precision", args.precision,
              "--device", "cuda" if args.gpu else "cpu", "--workers", str(args.workers),
              *(["--fresh-workers"] if fresh else [])]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", *script]
    elif launcher == "mp.spawn":
        cmd = [sys.executable, *script, "--spawn", str(args.nproc)]
    else:   # python: one process on its own
        cmd = [sys.executable, *script]
    e = env(args.gpu)
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


def interleaved(args, tmp: Path) -> None:
    kinds = ["builtin", "control"] if args.control else ["builtin"]
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.rounds):
        for kind in kinds:
            if kind == "builtin":
                m = run_interleaved("builtin_both", [f"task.steps={args.steps}", f"task.precision={args.precision}",
                                                     f"data.num_workers={args.workers}"], tmp / f"builtin{i}")
            else:
                m = run_interleaved("loop_both", [f"task.steps={args.steps}", "task.chunk=50", "+task.control=true"],
                                    tmp / f"control{i}")
            ratios[kind].append(m["run_steps_per_s"] / m["plain_steps_per_s"])
            what = "built-in loop" if kind == "builtin" else "plain #2 (A/A)"
            print(f"round {i + 1}/{args.rounds}: plain {m['plain_steps_per_s']:.0f} steps/s, {what} "
                  f"{m['run_steps_per_s']:.0f} steps/s, ratio {ratios[kind][-1]:.3f}", flush=True)
    workers = f", {args.workers} DataLoader worker(s) a rank and loop, kept" if args.workers else ""
    print(f"\n2 ranks, gloo, CPU, task a, precision {args.precision}{workers}, {args.steps} steps per loop in chunks "
          f"of 50, {args.rounds} launches")
    if args.control:
        c = ratios["control"]
        print(f"A/A control (plain vs plain, 32-bit): ratio {statistics.median(c):.3f} "
              f"(range {min(c):.3f}-{max(c):.3f}): the noise floor")
    b = ratios["builtin"]
    print(f"built-in loop vs the plain DDP loop, interleaved: steps/s ratio {statistics.median(b):.3f} "
          f"(range {min(b):.3f}-{max(b):.3f}) (goal >= 0.98)")


def launches(args, tmp: Path) -> None:
    bases = ["python"] if args.nproc == 1 else ["torchrun", "mp.spawn"]
    if args.workers:
        bases.append(f"{bases[0]}+fresh")
    results: dict[str, list] = {"expgpu": [], **{b: [] for b in bases}}
    for i in range(args.launches):
        results["expgpu"].append(run_expgpu(args.launch_steps, tmp, i, args))
        for j, base in enumerate(bases):
            results[base].append(run_plain(args.launch_steps, base, 29600 + 100 * j + i, args))
        print(f"launch round {i + 1}/{args.launches}: " + "  ".join(
            f"{k} start {v[-1][0]:.2f}s {v[-1][1]:.0f} steps/s" for k, v in results.items()), flush=True)
    med = {k: (statistics.median(s for s, _ in v), statistics.median(r for _, r in v)) for k, v in results.items()}
    where = "GPU" if args.gpu else "CPU"
    workers = f", {args.workers} DataLoader worker(s) a rank" if args.workers else ""
    print(f"\nseparate launches, {args.nproc} rank(s) on the {where}{workers}, {args.launch_steps} steps, median of "
          f"{args.launches} alternating rounds")
    for base in bases:
        ratio = med["expgpu"][1] / med[base][1]
        extra = med["expgpu"][0] - med[base][0]
        print(f"vs plain script under {base:8s}: startup {med['expgpu'][0]:.2f}s vs {med[base][0]:.2f}s: "
              f"extra {extra:+.2f}s (goal <= +0.30s); steps/s ratio {ratio:.3f} (separate launches: noisy)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5, help="interleaved launches")
    ap.add_argument("--steps", type=int, default=6000, help="steps per loop, interleaved")
    ap.add_argument("--precision", choices=["32", "bf16"], default="32")
    ap.add_argument("--control", action="store_true", help="also an A/A launch per round: the noise floor")
    ap.add_argument("--launches", type=int, default=3, help="separate-launch rounds (startup); 0: none")
    ap.add_argument("--launch-steps", type=int, default=1500)
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the separate launches (1: against plain python)")
    ap.add_argument("--gpu", action="store_true", help="the separate launches on this node's GPUs")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers a rank (and a loop, interleaved)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.rounds:
            interleaved(args, Path(tmp))
        if args.launches:
            launches(args, Path(tmp))


if __name__ == "__main__":
    main()
