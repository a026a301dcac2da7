"""What a job whose config reads Hydra's values for it (`task.seed=${hydra:job.num}`) costs a launcher, against
the same sweep with plain values (`task.seed=0..N-1`), in the same run.

Per job, what gpu_pool does before any job starts (expgpu.pool.launch._compose_all): compose it (its dir
computed, expgpu.pool.job_config.job_dir), check its ranges and a script task's args, and resolve its task
as the SLURM launchers' check before the queue does (expgpu.pool.job_config.resolved). The plain sweep's reads
succeed at once; the other's are tried again with the job's HydraConfig (expgpu.pool.job_config.in_job).
The two sweeps alternate, `--rounds` times each, after a warm-up (the imports; the part of a job's config that
its config files make, which a sweep composes once: expgpu.pool.compose); medians are compared.

    python bench/bench_job_config.py [--jobs 200] [--rounds 3]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def per_job_ms(loader, master, sweep: list[list[str]]) -> float:
    from expgpu import config
    from expgpu.pool import jobs
    from expgpu.pool.job_config import in_job, resolved
    from expgpu.script import spec

    start = time.perf_counter()
    for num, overrides in enumerate(sweep):
        job = jobs.compose(loader, master, overrides, num, lambda c: 0)
        in_job(job.config, config.check)
        in_job(job.config, lambda c: spec.checked(c, os.getcwd()))
        resolved(job.config, "task")
    return (time.perf_counter() - start) / len(sweep) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from expgpu import rundir, schema
    from expgpu.__main__ import conf_dir

    schema.register()
    rundir.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()

        class Context:   # what jobs.compose reads of Hydra's context
            config_loader = loader

        master = loader.load_configuration("config", ["hydra/launcher=gpu_pool", "hydra.sweep.dir=/tmp/bench-x"],
                                           RunMode.MULTIRUN)
        sweeps = {"plain": [[f"task.seed={i}", f"task.batch_size={i + 1}"] for i in range(args.jobs)],
                  "hydra": [["task.seed=${hydra:job.num}", f"task.batch_size={i + 1}"] for i in range(args.jobs)]}
        times: dict[str, list[float]] = {k: [] for k in sweeps}
        for sweep in sweeps.values():   # warm: the imports, and the config files' part composed once per sweep
            per_job_ms(Context, master, sweep[:5])
        for _ in range(args.rounds):
            for name, sweep in sweeps.items():
                times[name].append(per_job_ms(Context, master, sweep))
    plain, hydra = (statistics.median(times[k]) for k in ("plain", "hydra"))
    print(f"{args.jobs} jobs, {args.rounds} rounds; per job, composed and read as gpu_pool reads it before any start:")
    print(f"  task.seed=<N>                {plain:6.2f} ms")
    print(f"  task.seed=${{hydra:job.num}}   {hydra:6.2f} ms   ratio {hydra / plain:.2f}x "
          f"(+{hydra - plain:.2f} ms a job)")


if __name__ == "__main__":
    main()
