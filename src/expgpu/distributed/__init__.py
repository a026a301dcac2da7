"""With whom: the process group and what is done across it.

    group.py  backend choice (nccl only when every rank has its own GPU), init, teardown, collectives
    wrap.py   `run.wrap(module)`: DDP across ranks, DataParallel over one rank's GPUs, or FSDP2
    fsdp.py   `launch.wrap=fsdp`: fully_shard per unit, mixed precision, the sharded state's shape
    rng.py    every random generator a step may draw from: seeded per rank, captured, restored

Torch is imported inside functions: the launchers import this package's names without paying for it.
"""

__all__ = ["fsdp", "group", "rng", "wrap"]
