"""The gpu_pool launcher's work: run a Hydra sweep's jobs in parallel, each on GPUs of its own.

    launch.py     one launch() batch: settings, GPUs, every job's config, its thread budget, the loop
    session.py    the same pool for a sweeper that adds one job at a time and waits for any (expgpu.tune)
    settings.py   hydra.launcher.* checked; the GPUs a job needs
    scheduler.py  which job gets which GPUs or CPU slot; CPU threads per job (pure)
    loop.py       the event loop, a round at a time: reap ended jobs, signals, the end of a sweep
    starts.py     lease GPUs, ask the scheduler, hand jobs to spares, keep spares ready
    spares.py     a job's process before its job (a fork of the sweep's fork server, expgpu.procs.forkserver,
                  or one started on its own), the launcher's handle
    job_process.py the job's side: wait, set the job's environment, run_job, send back, exit
    jobs.py       a job, its files, pool.json (every batch's jobs)
    compose.py    each job's config as Hydra composes it, the config groups' part once per choice (slurm's too)
    leases.py     one lock file per GPU, shared by every sweep on the machine (and runs started by hand)
    sharing.py    hydra.launcher.jobs_per_gpu: each GPU as that many shares, a job's on different GPUs
    busy.py       hydra.launcher.busy_gpus: GPUs that processes outside expgpu compute on (NVML), waited for
    board.py      the live table / log lines
    allocation.py inside a SLURM allocation: its nodes, their GPUs and CPUs; where a job's GPUs fit (pure)
    steps.py      inside a SLURM allocation: each job an srun step (command, environment, CPUs, start)
    step_process.py the job in each task of its srun step

Each job runs in a process of its own, forked ahead of time from the sweep's fork server (Hydra,
torch and the task's modules imported once) but given nothing of its job, and no GPU, until its
GPUs are leased: then it gets its environment (CUDA_VISIBLE_DEVICES: its GPUs' NVML indices, with
CUDA_DEVICE_ORDER=PCI_BUS_ID; OMP/MKL_NUM_THREADS: its share of the cores) before any of the job's
code runs, so nothing in it can touch another job's GPU. Inside, expgpu's usual line runs on that
mask (the inventory is narrowed to the leased GPUs). GPUs are leased machine-wide (expgpu.pool.leases; a
run started by hand leases its own too, expgpu.launch.run_leases): the job's process holds the lock, so a
GPU frees itself when its job ends, however it ends, and two sweeps never share a GPU (but by
hydra.launcher.jobs_per_gpu: a share of it each, expgpu.pool.sharing).

Jobs run in their own process group (session), so a Ctrl-C at the terminal reaches only the
launcher, which passes it on to every running job (expgpu checkpoints and stops), waits grace_s,
then SIGKILLs what is left; queued jobs never start. Jobs die with the launcher (PR_SET_PDEATHSIG).

Inside a SLURM allocation (salloc, sbatch) the pool is the allocation's GPUs on every node, counted by the
launcher (no leases: SLURM gives no GPU to two steps), and each job is an srun step on the node(s) it was
given, started when its GPUs are free (no spares: a step starts its own Python).

Nothing heavy is imported here or at Hydra start-up; the plugin imports launch() inside its launch().
"""

from expgpu.pool.launch import launch
from expgpu.pool.scheduler import Scheduler

__all__ = ["launch", "Scheduler"]
