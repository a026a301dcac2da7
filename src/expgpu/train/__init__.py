"""The Run API and what only it uses.

    run.py           `Run`, the one object a training function meets (expgpu.Run)
    run_checkpoint.py its checkpoint: the read before the first step, the restore, the saves, the stop
    run_end.py       its end (last rows, loggers, result.json) and where it is, for the hang watchdog
    run_args.py      run.steps' and run.epochs' arguments, checked in one line
    agreement.py     the ranks agree on a stop at a step boundary (the signals: expgpu.procs.signals)
    batches.py       the batches run.steps hands out: this rank's share of every epoch, and the resume point
    loaders.py       run.loader's DataLoader, and a script's own rebuilt as one
    proportional.py  data.shard=proportional|auto: each rank's share of the global batch by its speed
    watchdog.py      the hang watchdog: a step that takes too long, found and named

Everything a user's loop should not have to write lives behind `Run`; `from expgpu import Run` is
the public door (this package's names may move).
"""

__all__ = ["agreement", "batches", "loaders", "proportional", "run", "run_args", "run_checkpoint", "run_end",
           "watchdog"]
