"""expgpu: run PyTorch experiments on the right GPUs, from Hydra config.

Nothing heavy is imported here: `python -m expgpu` must not pay for torch before it
knows which GPU it owns (CUDA_VISIBLE_DEVICES is set before CUDA starts).
"""

__version__ = "0.1.0"

from expgpu import lazy

__all__ = ["Run", "StopTraining", "log", "__version__"]

# `from expgpu import Run` without importing train/run.py (and what it imports) for every CLI start; `log`: a
# script task's metrics (expgpu/script/log.py), no torch, no Run
__getattr__ = lazy.names("expgpu", {"Run": "train.run", "StopTraining": "train.run", "log": "script.log"})
