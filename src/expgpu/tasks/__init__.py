"""Built-in tasks: small models and datasets that train in seconds on a CPU.

A task is config, not code: conf/task/<name>.yaml names a model, a dataset and an
optimizer by `_target_`; these modules only hold the classes those targets point at.
"""
