"""A model for task.model._target_ that notes the size of every batch it evaluates (eval mode) in
$EVAL_SIZES_DIR/rank<RANK>.txt, one per line: which batches the built-in loop's evaluation used."""

from __future__ import annotations

import os
from pathlib import Path

from expgpu.tasks.models import MLP


class EvalSizes(MLP):
    def forward(self, x):
        if not self.training:
            path = Path(os.environ["EVAL_SIZES_DIR"]) / f"rank{os.environ.get('RANK', '0')}.txt"
            with open(path, "a") as f:
                f.write(f"{x.shape[0]}\n")
        return super().forward(x)
