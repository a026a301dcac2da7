"""Not in the stand-in: libraries that probe torchvision when it is importable (torchmetrics, which
Lightning imports) import names from here; each raises only if it is called."""


def __getattr__(name):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"{__name__}.{name} is not part of this torchvision stand-in")
    return missing
