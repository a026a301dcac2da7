"""A task module that cannot be imported: it needs a package that is not installed."""

import a_dependency_not_installed  # noqa: F401


def train(run):
    pass
