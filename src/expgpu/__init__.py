"""expgpu: run PyTorch experiments on the right GPUs, from Hydra config.

Nothing heavy is imported here: `python -m expgpu` must not pay for torch before it
knows which GPU it owns (CUDA_VISIBLE_DEVICES is set before CUDA starts).
"""

__version__ = "0.1.0"
