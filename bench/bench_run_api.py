"""The Run API's cost on the hot path: a user's loop through run.steps / run.log vs the same loop
written plainly against torch (2 ranks, gloo, CPU, task a's model and data).

    python bench/bench_run_api.py [--rounds 5] [--steps 6000] [--chunk 50] [--nproc 2] [--control] [OVERRIDE ...]
    python bench/bench_run_api.py --separate [--rounds 7] [--steps 3000]
    python bench/bench_run_api.py --gpu --nproc 1     # on a GPU node: both loops on the rank's GPU
    python bench/bench_run_api.py --gpu --nproc 1 +task.hidden=16384   # a step the GPU's work decides

Default (interleaved): both loops in one expgpu launch, in the same processes, taking turns every
--chunk steps (user_loops.interleaved), so that a noisy machine slows both alike; each round is
one launch, and gives the median of its per-pair ratios and the ratio of its totals.
--gpu: the same on the node's GPUs (gpu_map=ranked, one per rank); the plain loop moves its model and
pinned batches to the GPU as such a script does, and each chunk's time ends with a synchronize. The
tiny model leaves the GPU idle most of a step, so any CPU work the Run API adds shows in full;
+task.hidden=16384 makes the GPU's work the step's length instead, where a loop that waits for the GPU
(the plain loop's loss.item() every 10 steps; run.log queues its copy without a wait) idles it.
--separate: each loop in a launch of its own, alternating (the older form; on a shared 2-core
machine two runs of one command differ by 10-40 %, far more than the cost measured here).

steps/s ratio = run.steps / plain loop     (goal >= 0.99)
The hang watchdog (one rank or several) runs in both loops' processes: its thread's CPU share is printed, the
most it can slow a loop (so a plain loop without it would be at most 1 / (1 - share) as fast).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from paths import pythonpath

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def run(task: str, args: list[str], nproc: int, run_dir: Path, gpu: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""   # the CPU benchmark it says it is, on a GPU node too
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(BENCH, REPO / "src"))
    subprocess.run([sys.executable, "-m", "expgpu", "--config-dir", str(BENCH / "conf"), f"task={task}", *args,
                    f"launch.nproc_per_node={nproc}", "checkpoint.resume=false", f"hydra.run.dir={run_dir}"],
                   check=True, env=env, cwd=REPO, capture_output=True)
    return json.loads((run_dir / "result.json").read_text())["metrics"]


def interleaved(args) -> None:
    kinds = ["run", "control"] if args.control else ["run"]
    pairs: dict[str, list[float]] = {k: [] for k in kinds}
    watchdog: list[float] = []
    totals: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for kind in kinds:
                m = run("loop_both", [f"task.steps={args.steps}", f"task.chunk={args.chunk}",
                                      f"+task.control={kind == 'control'}", *args.overrides],
                        args.nproc, Path(tmp) / f"{kind}{i}", args.gpu)
                pairs[kind].append(m["ratio_median"])
                if m.get("watchdog_cpu_share") is not None:
                    watchdog.append(m["watchdog_cpu_share"])
                totals[kind].append(m["run_steps_per_s"] / m["plain_steps_per_s"])
                what = "run.steps" if kind == "run" else "plain #2 (A/A)"
                print(f"round {i + 1}/{args.rounds}: plain {m['plain_steps_per_s']:.0f} steps/s, {what} "
                      f"{m['run_steps_per_s']:.0f} steps/s; ratio of totals {totals[kind][-1]:.3f}, median of "
                      f"{args.steps // args.chunk - 1} chunk pairs {pairs[kind][-1]:.3f}", flush=True)
    where = "one GPU each (gpu_map=ranked)" if args.gpu else "gloo, CPU"
    print(f"\n{args.nproc} rank(s), {where}, {args.steps} steps per loop in chunks of {args.chunk}, "
          f"{args.rounds} launches")
    if args.control:
        control = statistics.median(totals["control"])
        print(f"A/A control (a second plain loop in the Run loop's place): ratio {control:.3f}"
              f" (range {min(totals['control']):.3f}-{max(totals['control']):.3f}): the noise floor")
    print(f"run.steps/run.log vs the plain loop, interleaved: steps/s ratio {statistics.median(totals['run']):.3f} "
          f"(median over launches of the ratio of totals, range {min(totals['run']):.3f}-{max(totals['run']):.3f}; "
          f"median of chunk-pair medians {statistics.median(pairs['run']):.3f}) (goal >= 0.99)")
    if watchdog:   # both loops run beside it: its whole CPU time is what it can cost them
        print(f"the hang watchdog's thread (on in both loops' processes): {100 * statistics.median(watchdog):.3f} % "
              f"of a core (rank 0, median over launches): a plain loop without it is at most "
              f"{1 / (1 - statistics.median(watchdog)):.4f}x as fast")
    else:
        print("the hang watchdog was off (launch.hang.timeout_s=null)")


def separate(args) -> None:
    rates: dict[str, list[float]] = {"loop_plain": [], "loop_run": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = list(rates) if i % 2 == 0 else list(reversed(rates))
            for task in order:
                m = run(task, [f"task.steps={args.steps}", *args.overrides], args.nproc, Path(tmp) / f"{task}{i}")
                rates[task].append(m["steps_per_s"])
            print(f"round {i + 1}/{args.rounds}: plain {rates['loop_plain'][-1]:.0f} steps/s, "
                  f"run.steps {rates['loop_run'][-1]:.0f} steps/s", flush=True)
    plain, api = statistics.median(rates["loop_plain"]), statistics.median(rates["loop_run"])
    paired = statistics.median(r / p for r, p in zip(rates["loop_run"], rates["loop_plain"]))
    print(f"\n{args.nproc} rank(s), gloo, CPU, {args.steps} steps, median of {args.rounds} alternating rounds")
    print(f"run.steps/run.log vs the plain loop: steps/s ratio {api / plain:.3f} (medians {api:.0f} / {plain:.0f}), "
          f"median of per-round ratios {paired:.3f} (goal >= 0.99)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--separate", action="store_true", help="each loop in a launch of its own")
    ap.add_argument("--rounds", type=int, default=None, help="launches (default 5; --separate: 7 per loop)")
    ap.add_argument("--steps", type=int, default=None, help="steps per loop (default 6000; --separate: 3000)")
    ap.add_argument("--chunk", type=int, default=50, help="steps per turn, interleaved")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--control", action="store_true", help="also an A/A launch per round: the noise floor")
    ap.add_argument("--gpu", action="store_true", help="on this node's GPUs, one per rank")
    ap.add_argument("overrides", nargs="*", help="expgpu overrides for every launch, e.g. checkpoint.poll_every=10")
    args = ap.parse_args()
    if args.separate:
        args.rounds, args.steps = args.rounds or 7, args.steps or 3000
        return separate(args)
    args.rounds, args.steps = args.rounds or 5, args.steps or 6000
    if args.gpu:
        args.overrides = ["gpu_map=ranked", *args.overrides]
    interleaved(args)


if __name__ == "__main__":
    main()
