"""expgpu's Hydra sweeper (hydra/sweeper=expgpu_optuna), found by Hydra's plugin discovery.

Hydra imports every module here on every start: the module stays thin (its config dataclass in
the ConfigStore, a Sweeper that imports expgpu.tune, and through it Optuna, inside sweep()).
"""
