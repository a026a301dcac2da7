"""A torchrun-style script for the script-task tests: records how it was started, logs, fails or stops on demand.

    python probe_script.py [--steps N] [--step-s S] [--log] [--fail-rank R --fail-code C [--fail-at S] [--fail-once]]
                           [--on-term default|save|ignore] [--save-every N] [--resume] [--lr X] [--data PATH]
                           [--print-steps] [--hang-at S [--hang-rank R] [--hang-once]]

It writes into its working directory (the run dir): started-rank<R>.json (its torchrun variables,
CUDA_VISIBLE_DEVICES, argv, cwd), at-rank<R> (the step it is at), ckpt.txt (on SIGTERM or
SIGUSR2 with --on-term save, and from rank 0 every --save-every steps), done-rank<R>.json at the end.
--fail-once: rank R fails only where it has not failed before (failed-rank<R> in the run dir). --print-steps:
a line per step. --hang-at S: after step S (its row logged, its line printed), rank R (every rank without
--hang-rank) sleeps for ever, silently, having written hung-rank<R> (when, and its step); --hang-once: only
where it has not hung before. No torch: the tests stay fast.
"""

import argparse
import json
import os
import signal
import sys
import time

VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "PYTHONPATH", "EXPGPU_RANK")

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--step-s", type=float, default=0.0)
p.add_argument("--log", action="store_true")
p.add_argument("--fail-rank", type=int, default=None)
p.add_argument("--fail-code", type=int, default=3)
p.add_argument("--fail-at", type=int, default=1)
p.add_argument("--fail-once", action="store_true")
p.add_argument("--save-every", type=int, default=0)
p.add_argument("--on-term", choices=["default", "save", "ignore"], default="default")
p.add_argument("--resume", action="store_true")
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--data", default=None)
p.add_argument("--print-steps", action="store_true")
p.add_argument("--hang-at", type=int, default=None)
p.add_argument("--hang-rank", type=int, default=None)
p.add_argument("--hang-once", action="store_true")
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))


def write(name, doc):
    tmp = f".{name}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, name)


write(f"started-rank{rank}.json", {"env": {k: os.environ.get(k) for k in VARS}, "argv": sys.argv[1:],
                                   "cwd": os.getcwd(), "pid": os.getpid(),
                                   "data_exists": args.data is not None and os.path.exists(args.data)})
stop = []
if args.on_term == "save":   # SLURM's warning before a time limit (SIGUSR2) too
    signal.signal(signal.SIGTERM, lambda signum, _: stop.append(signum))
    signal.signal(signal.SIGUSR2, lambda signum, _: stop.append(signum))
elif args.on_term == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

first = 0
if args.resume and os.path.exists("ckpt.txt"):
    first = int(open("ckpt.txt").read())
for step in range(first, args.steps):
    failed_before = args.fail_once and os.path.exists(f"failed-rank{rank}")
    if args.fail_rank == rank and step == args.fail_at and not failed_before:
        open(f"failed-rank{rank}", "w").close()
        print(f"rank {rank} about to fail", flush=True)
        print("Traceback (most recent call last):", file=sys.stderr)
        print("ValueError: injected failure", file=sys.stderr, flush=True)
        sys.exit(args.fail_code)
    time.sleep(args.step_s)
    with open(f".at-rank{rank}", "w") as f:
        f.write(str(step + 1))
    os.replace(f".at-rank{rank}", f"at-rank{rank}")
    if args.log:
        import expgpu

        expgpu.log(loss=args.lr / (step + 1), step=step + 1)
    if args.print_steps:
        print(f"rank {rank}: step {step + 1}", flush=True)
    if args.hang_at == step + 1 and args.hang_rank in (None, rank) and \
            not (args.hang_once and os.path.exists(f"hung-rank{rank}")):
        write(f"hung-rank{rank}", {"at": time.time(), "step": step + 1})
        while True:
            time.sleep(3600)
    if args.save_every and rank == 0 and (step + 1) % args.save_every == 0:
        with open(".ckpt.txt", "w") as f:
            f.write(str(step + 1))
        os.replace(".ckpt.txt", "ckpt.txt")
    if stop:
        with open("ckpt.txt", "w") as f:
            f.write(str(step + 1))
        print(f"rank {rank}: {signal.Signals(stop[0]).name}, saved step {step + 1}", flush=True)
        sys.exit(128 + stop[0])
if args.log:
    import expgpu

    expgpu.log(val_loss=args.lr / 10, step=args.steps)
write(f"done-rank{rank}.json", {"steps": args.steps, "first": first})
print(f"rank {rank}: done {args.steps} steps", flush=True)
