"""The collectives of expgpu.train.run.Run that a training function calls: each rank's values summed, gathered or
broadcast over the run's ranks, and a barrier; on one rank, the value itself. A mixin of Run: it reads the rank's
device and world size."""

from __future__ import annotations

from expgpu.distributed import gather, group


class RunCollectives:
    def all_reduce(self, value, op: str = "sum"):
        """`value` summed (or "mean", "max", "min") over all ranks, returned on every rank: a
        tensor (a new one, detached), a number, or a dict of them; as it is on one rank.
        Collective: every rank calls it, with the same keys. For metrics each rank computed on
        its share, e.g. an evaluation's (loss sum, count)."""
        return group.reduce_value(value, op, self.device)

    def gather(self, value):
        """Every rank's `value`, in rank order, on every rank: tensors concatenated along their first dimension,
        which may differ by rank (each rank's share of an evaluation: its predictions, for a metric computed on
        all of them), a dict entry by entry, anything else as a list of each rank's. Collective: every rank
        calls it. On one rank, the value itself (a 0-d tensor as one entry)."""
        return gather.gather_value(value, self.device)

    def broadcast(self, obj, src: int = 0):
        """Rank `src`'s `obj` (anything picklable: a choice rank 0 made, a path it wrote), on every rank.
        Collective: every rank calls it."""
        return gather.broadcast_object(obj, src, self.world_size)

    def barrier(self) -> None:
        """Every rank waits here for all the others (e.g. while rank 0 downloads the data)."""
        group.barrier()
