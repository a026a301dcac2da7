"""expgpu: run PyTorch experiments on the right GPUs, from Hydra config.

Nothing heavy is imported here: `python -m expgpu` must not pay for torch before it
knows which GPU it owns (CUDA_VISIBLE_DEVICES is set before CUDA starts).
"""

__version__ = "0.1.0"

__all__ = ["Run", "StopTraining", "log", "__version__"]


def __getattr__(name: str):
    # `from expgpu import Run` without importing train/run.py (and what it imports) for every CLI start.
    if name in ("Run", "StopTraining"):
        from expgpu.train import run

        return getattr(run, name)
    if name == "log":   # a script task's metrics (expgpu/script/log.py); no torch, no Run
        from expgpu.script.log import log

        return log
    raise AttributeError(f"module 'expgpu' has no attribute {name!r}")
