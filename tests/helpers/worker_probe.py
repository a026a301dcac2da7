"""A dataset for the tests of the built-in loop's DataLoader workers (`_target_: worker_probe.WorkerPids`,
with tests/ on PYTHONPATH): it records each process that fetches from it, so a test counts the
worker processes a loader started over a run."""

from __future__ import annotations

import os

from shard_probe import IndexLog


class WorkerPids(IndexLog):
    """shard_probe.IndexLog's examples; instead of each index, the first fetch in each process appends that
    process's pid to LOG_DIR/rank<R>.txt (R: EXPGPU_RANK)."""

    def __init__(self, log_dir: str, size: int = 256, in_features: int = 32, out_features: int = 4):
        super().__init__(log_dir, size, in_features, out_features)
        self._pid = None

    def __getitem__(self, i):
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / f"rank{os.environ.get('EXPGPU_RANK', '0')}.txt", "a") as f:
                f.write(f"{self._pid}\n")
        return self.x[i], self.y[i]
