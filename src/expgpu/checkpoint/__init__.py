"""What a stop keeps, and putting it back exactly.

    state.py         CheckpointState: the checkpoint half of `Run` (what run.track and keep= hold, when to save)
    keep.py          KeptLocals: the loop variables `keep=` names, per rank
    tensors.py       moving state trees to the CPU and back onto the devices they came from
    file.py          checkpoint.pt: atomic writes, tensors-only loads, a torn or mismatched file is an error
    sharded.py       the sharded format (torch.distributed.checkpoint) under launch.wrap=fsdp
    world_change.py  resuming on another number of ranks: what W ranks' checkpoint gives each of W'
    verify.py        checkpoint.verify=true: stop halfway, resume, compare with an uninterrupted run

The run dir names the files (expgpu.rundir); the format stays readable across these modules' moves.
"""

__all__ = ["file", "keep", "sharded", "state", "tensors", "verify", "world_change"]
