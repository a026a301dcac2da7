"""Script tasks: a training script that runs under torchrun, run as an expgpu task unchanged.

    # conf/task/nanogpt.yaml                    python -m expgpu task=nanogpt task.args.max_iters=50
    script: train.py                            # or module: pkg.train (python -m pkg.train)
    args: {device: cpu, compile: false}
    args_style: configurator
    inputs: [data, configurator.py]
    resume_args: {init_from: resume}
    resume_if: out/ckpt.pt

docs/architecture.md's straight line is the same up to this node's GPU plan. There a function task isolates its
GPU, joins a process group and calls fn(run); a script task's rank instead starts the script in a
child process, with torchrun's variables and the plan's CUDA_VISIBLE_DEVICES, in the run dir, and
supervises it (expgpu.launch.worker.run_rank hands over to expgpu.script.runner). The script creates its own process
group. Modules:

    spec       the task file's keys, checked before any rank starts (and by a sweep's launchers before any
               job starts: checked) -> ScriptSpec (command, args, paths)
    environ    a rank's child environment: torchrun's variables and the GPU mask
    process    the script's process: output to the console and the run dir, stops passed on, grace
    runner     one rank: resume or not, inputs linked, the script, how it ended; rank 0's result.json
    result     every rank's record of how its script ended, rank 0's result.json, a failure's line
    log        expgpu.log(), called in the script's own process
    heartbeat  expgpu.log's beat, which the rank's supervisor reads (shared memory, no I/O)
    watch      the ranks' hang watch of their scripts
    loggers    rank 0 hands the chosen loggers the rows expgpu.log writes, and shows the progress

Nothing here imports torch: the process that supervises a script never needs it.
"""

from expgpu.script.spec import ScriptSpec, is_script, prepare

__all__ = ["ScriptSpec", "is_script", "prepare"]
