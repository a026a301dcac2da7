"""A launch's start with a warm server (EXPGPU_WARM_SERVER, expgpu.launch.warm_server) against the same
launch without one, alternating in the same run:

    python bench/bench_warm_server.py [--rounds 5] [--steps 20]

For task `a` on 1 and on 2 ranks, `python -m expgpu ...` is run in turns with and without the
server. Per launch:
  wall     the whole command, Hydra's start-up and the training's 20 steps included
  startup  result.json's timing.startup_s: from the launcher's start to the first training step
  cpu      CPU-seconds of every process of the launch: the launcher and its children (rusage),
           and, with the server, what the server and its forks used meanwhile (psutil)
Medians are compared (server / without). Without a server a 2-rank launch already forks its ranks
from a warm process of its own (expgpu.launch.warm), and a 1-rank launch trains in the launcher.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def _cpu(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def launch(nproc: int, steps: int, run_dir: Path, env: dict, server: psutil.Process | None) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_before = _cpu(server)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "expgpu", "task=a", f"task.max_steps={steps}",
                    f"launch.nproc_per_node={nproc}", f"hydra.run.dir={run_dir}"],
                   cwd=REPO, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) + _cpu(server) - server_before
    startup = json.loads((run_dir / "result.json").read_text())["timing"]["startup_s"]
    return {"wall": wall, "startup": startup, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="expgpu-bench-warm-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPGPU_", "SLURM_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""   # the CPU benchmark it says it is, on a GPU node too
    env.update(OMP_NUM_THREADS="1")
    path = str(tmp / "s")
    proc = subprocess.Popen([sys.executable, "-m", "expgpu.launch.warm_server", path], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        if "ready" not in proc.stderr.readline():
            sys.exit("the warm server did not start")
        server = psutil.Process(proc.pid)
        seen: dict[tuple[int, str], list[dict]] = {}
        for r in range(args.rounds):
            for nproc in (1, 2):
                for mode in (("server", "without") if r % 2 else ("without", "server")):
                    e = dict(env, EXPGPU_WARM_SERVER=path if mode == "server" else "")
                    got = launch(nproc, args.steps, tmp / f"{nproc}-{mode}-{r}", e,
                                 server if mode == "server" else None)
                    seen.setdefault((nproc, mode), []).append(got)
        print(f"task a, {args.steps} steps, {args.rounds} launches each, medians (cores: {os.cpu_count()})")
        print(f"{'ranks':>5} {'':>8} {'wall s':>8} {'startup s':>10} {'cpu s':>8}")
        for nproc in (1, 2):
            med = {mode: {k: statistics.median(x[k] for x in seen[nproc, mode]) for k in ("wall", "startup", "cpu")}
                   for mode in ("without", "server")}
            for mode in ("without", "server"):
                m = med[mode]
                print(f"{nproc:>5} {mode:>8} {m['wall']:8.2f} {m['startup']:10.2f} {m['cpu']:8.2f}")
            ratio = {k: med["server"][k] / med["without"][k] for k in ("wall", "startup", "cpu")}
            print(f"{nproc:>5} {'ratio':>8} {ratio['wall']:8.2f} {ratio['startup']:10.2f} {ratio['cpu']:8.2f}"
                  "   (server / without)")
    finally:
        proc.terminate()
        proc.wait(20)


if __name__ == "__main__":
    main()
