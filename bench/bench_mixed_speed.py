"""Mixed-speed ranks: throughput of data.shard=uniform / proportional / auto against the ideal.

2 ranks, gloo, CPU, one thread each; rank 1 is made `--slow` times slower (faults.slow_rank=1:
it sleeps (slow - 1) x its own compute time, as an older GPU would take longer). By default
each rank also emulates a device (faults.device_ms_per_example=--device-ms: it sleeps that long
per example of its batch, x slow on rank 1) while the CPU waits, as it does for a GPU: on a
small CPU box shared with other work, wall-clock CPU compute mostly measures the neighbours'
load; with --device-ms 0 the ranks run on real CPU compute alone. The ideal is
the sum of the two ranks' speeds alone: one process of the fast kind and one of the slow kind,
each training the same model at the per-rank batch with no process group, started together so
that they share the machine as the two ranks of a run do (on a dedicated node that is the same
as one after the other; on a shared CPU box it is the only fair ideal). Runs alternate within
each round (the two singles, uniform, proportional, auto) so that machine noise hits all alike;
the ratio to the ideal is taken per round, and the median over rounds is printed.

proportional gets data.weights from the two single speeds of the same round (what a user
with known GPU speeds, or gpu_map.score=measured, gives it); auto measures for itself.

    python bench/bench_mixed_speed.py [--rounds 3] [--steps 150] [--slow 2] [--device-ms 0.2]

examples/s ratio to ideal: goal >= 0.9 for proportional and auto; uniform is about
(1 + 1/slow) / (1 + 1/slow) ... i.e. 2 x slow speed / (fast + slow) = 0.67 for slow=2.
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
MODEL = ["task=a", "task.dataset.size=16384", "task.log_every=10", "checkpoint.resume=false"]


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EXPGPU_", "TORCHELASTIC_"))}
    e["CUDA_VISIBLE_DEVICES"] = ""   # the CPU benchmark it says it is, on a GPU node too
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(REPO / "src"))
    return e


def examples_per_s(run_dir: Path, global_batch: int, skip: int) -> float:
    """From metrics.jsonl times: steps after `skip` (warm-up and auto's measuring window)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= skip]
    first, last = rows[0], rows[-1]
    return (last["step"] - first["step"]) * global_batch / (last["time"] - first["time"])


def start(args: list[str], run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "expgpu", *MODEL, *args, f"hydra.run.dir={run_dir}"],
                            env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, run_dir: Path, global_batch: int, skip: int) -> tuple[float, dict]:
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        sys.exit(f"run in {run_dir} failed:\n{err.decode()[-2000:]}")
    result = json.loads((run_dir / "result.json").read_text())
    return examples_per_s(run_dir, global_batch, skip), result


def run(args: list[str], run_dir: Path, global_batch: int, skip: int) -> tuple[float, dict]:
    return finish(start(args, run_dir), run_dir, global_batch, skip)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--slow", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=512, help="per-rank batch (global = 2 x this)")
    ap.add_argument("--device-ms", type=float, default=0.2, help="emulated device ms per example (0: off)")
    a = ap.parse_args()
    MODEL.append(f"faults.device_ms_per_example={a.device_ms}")
    bs, skip = a.batch, 50   # auto rebalances at step 20 (data.auto_steps); time from step 50 on
    steps, slow = [f"task.max_steps={a.steps}", f"task.batch_size={bs}"], [f"faults.slow_factor={a.slow}"]
    two = steps + ["launch.nproc_per_node=2", "faults.slow_rank=1"] + slow
    ratios: dict[str, list[float]] = {"uniform": [], "proportional": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            d = Path(tmp) / str(i)
            both = start(steps, d / "fast"), start(steps + ["faults.slow_rank=0"] + slow, d / "slow")
            (fast, _), (slower, _) = finish(both[0], d / "fast", bs, skip), finish(both[1], d / "slow", bs, skip)
            ideal = fast + slower
            line = f"round {i + 1}/{a.rounds}: alone {fast:.0f} + {slower:.0f} = ideal {ideal:.0f} ex/s"
            for mode, extra in (("uniform", []),
                                ("proportional", [f"data.weights=[{fast:.1f},{slower:.1f}]"]),
                                ("auto", [])):
                speed, result = run(two + [f"data.shard={mode}", *extra], d / mode, 2 * bs, skip)
                ratios[mode].append(speed / ideal)
                line += f" | {mode} {speed:.0f} ({speed / ideal:.2f}, split {result['shard']['sizes']})"
            print(line, flush=True)
    print(f"\n2 ranks, gloo, CPU, rank 1 {a.slow:g}x slower, emulated device {a.device_ms:g} ms/example, "
          f"global batch {2 * bs}, {a.steps} steps, "
          f"median of {a.rounds} alternating rounds; examples/s as a ratio to the ideal (sum of single speeds)")
    expect_uniform = 2 / (1 + a.slow)
    for mode, values in ratios.items():
        goal = "goal >= 0.90" if mode != "uniform" else f"expected about {expect_uniform:.2f}"
        print(f"  {mode:12s} {statistics.median(values):.3f}  ({goal}; rounds: "
              f"{', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
