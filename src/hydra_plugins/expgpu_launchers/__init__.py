"""expgpu's Hydra launchers, found by Hydra's plugin discovery (the hydra_plugins namespace).

Hydra imports every module here on every start, so each module stays thin: its config
dataclass registered in the ConfigStore, and a Launcher that imports the real work from
expgpu lazily, inside launch().
"""
