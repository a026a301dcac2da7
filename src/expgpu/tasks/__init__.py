"""Built-in tasks: small models and datasets that train in seconds on a CPU.

A task is config, not code: conf/task/<name>.yaml names a model, a dataset and an
optimizer by `_target_`; these modules only hold the classes those targets point at.

    supervised.py  the built-in loop (model + dataset + optimizer + loss), written on the public Run only
    models.py      MLP and friends
    data.py        synthetic datasets (task a, b)
    digits.py      scikit-learn's 8x8 digits (task digits)
"""

__all__ = ["data", "digits", "models", "supervised"]
