"""launch.wrap=fsdp against plain FSDP2, and what sharding and async_save buy (2 gloo ranks, CPU).

    python bench/bench_fsdp.py [--rounds 3] [--steps 200] [--quick]

A small GPT-like model (examples/my_tasks/charlm.py's CharTransformer, 4 Transformer blocks as
FSDP units) on random tokens:
(a) run.wrap + run.steps under launch.wrap=fsdp vs the same model sharded by hand with fully_shard
    in a plain loop: both in one launch, taking turns every --chunk steps (bench_run_api.py's
    interleaving; which goes first alternates between launches), so that machine noise hits both
    alike. steps/s ratio (goal >= 0.97)
(b) the largest parameter + AdamW-state bytes a rank holds, fsdp / ddp (goal <= 0.55)
(c) checkpoint.every_steps with checkpoint.async_save=true vs false: the training stall per save,
    async / sync (goal <= 0.2), launches alternating.
--quick: one round of each, shorter, for a look in under a minute.
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
UNITS = "launch.fsdp.units=[TransformerEncoderLayer]"


def run(task: str, args: list[str], nproc: int, run_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""   # the CPU benchmark it says it is, on a GPU node too
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=pythonpath(BENCH, REPO / "examples", REPO / "src"))
    done = subprocess.run([sys.executable, "-m", "expgpu", "--config-dir", str(BENCH / "conf"), f"task={task}", *args,
                           f"launch.nproc_per_node={nproc}", "checkpoint.resume=false", f"hydra.run.dir={run_dir}"],
                          env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{task} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "result.json").read_text())["metrics"]


def _range(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f})"


def wrap_vs_plain(args, tmp: Path) -> list[float]:
    ratios = []
    for i in range(args.rounds):
        m = run("fsdp_wrap_vs_plain", ["launch.wrap=fsdp", UNITS, f"task.steps={args.steps}",
                                       f"task.chunk={args.chunk}", f"+task.run_first={i % 2 == 1}"],
                args.nproc, tmp / f"a{i}")
        ratios.append(m["run_steps_per_s"] / m["plain_steps_per_s"])
        print(f"(a) round {i + 1}/{args.rounds}: plain fully_shard {m['plain_steps_per_s']:.1f} steps/s, run.wrap "
              f"{m['run_steps_per_s']:.1f} steps/s; ratio of totals {ratios[-1]:.3f}, median of chunk pairs "
              f"{m['ratio_median']:.3f}", flush=True)
    return ratios


def held(args, tmp: Path) -> dict[str, dict]:
    out = {}
    for wrap in ("ddp", "fsdp"):
        extra = [UNITS] if wrap == "fsdp" else []
        out[wrap] = run("fsdp_held_bytes", [f"launch.wrap={wrap}", *extra], args.nproc, tmp / f"b{wrap}")
    return out


def stalls(args, tmp: Path) -> dict[str, list[dict]]:
    got: dict[str, list[dict]] = {"sync": [], "async": []}
    for i in range(args.rounds):
        for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):
            m = run("fsdp_save_stall", ["launch.wrap=fsdp", UNITS, f"checkpoint.every_steps={args.every}",
                                        f"checkpoint.async_save={mode == 'async'}", f"task.steps={args.save_steps}"],
                    args.nproc, tmp / f"c{mode}{i}")
            got[mode].append(m)
            print(f"(c) round {i + 1}/{args.rounds} {mode:5}: stall per save {m['stall_per_save_s'] * 1e3:.1f} ms, "
                  f"run time per save {m['time_per_save_s'] * 1e3:.1f} ms, a step {m['step_s'] * 1e3:.1f} ms",
                  flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="(a): steps per loop")
    ap.add_argument("--chunk", type=int, default=20, help="(a): steps per turn")
    ap.add_argument("--every", type=int, default=16, help="(c): checkpoint.every_steps")
    ap.add_argument("--save-steps", type=int, default=80, help="(c): steps per launch")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one round, fewer steps")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.save_steps = 1, 100, 64
    with tempfile.TemporaryDirectory() as tmp:
        a = wrap_vs_plain(args, Path(tmp))
        b = held(args, Path(tmp))
        c = stalls(args, Path(tmp))
    print(f"\n{args.nproc} ranks, gloo, CPU; CharTransformer, 4 blocks as FSDP units; {args.rounds} round(s)")
    print(f"(a) run.wrap (launch.wrap=fsdp) vs plain fully_shard loop, interleaved: steps/s ratio {_range(a)} "
          "(goal >= 0.97)")
    for kind in ("params", "optimizer"):
        key = f"max_rank_{kind}_bytes"
        print(f"(b) {kind} bytes on the fullest rank: ddp {b['ddp'][key] / 2**20:.2f} MiB, fsdp "
              f"{b['fsdp'][key] / 2**20:.2f} MiB")
    both = sum(b["fsdp"][f"max_rank_{k}_bytes"] for k in ("params", "optimizer")) / \
        sum(b["ddp"][f"max_rank_{k}_bytes"] for k in ("params", "optimizer"))
    print(f"(b) parameter + optimizer bytes per rank, fsdp / ddp: {both:.3f} (goal <= 0.55)")
    sync = [m["stall_per_save_s"] for m in c["sync"]]
    asyn = [m["stall_per_save_s"] for m in c["async"]]
    ratio = [a_ / s_ for a_, s_ in zip(asyn, sync)]
    print(f"(c) training stall per save: sync {statistics.median(sync) * 1e3:.1f} ms, async "
          f"{statistics.median(asyn) * 1e3:.1f} ms; async / sync {_range(ratio)} (goal <= 0.2)")
    per = [a_["time_per_save_s"] / s_["time_per_save_s"] for a_, s_ in zip(c["async"], c["sync"])]
    print(f"(c) the run's time per save beyond its steps (the background write included), async / sync: "
          f"{_range(per)}")


if __name__ == "__main__":
    main()
