"""The config `python -m expgpu OVERRIDES` runs with, composed in the test's own process (Hydra's
compose, as hydra.main does), and the one line the CLI prints for a mistake in it."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from expgpu import config, rundir, schema, task
from expgpu.__main__ import _one_line, conf_dir
from expgpu.errors import UserError
from expgpu.gpus import placement


def composed(*overrides: str, hydra: bool = False):
    """The config `python -m expgpu OVERRIDES` runs with (Hydra's compose, as hydra.main does); with its
    `hydra` node (as a launcher's job config has it) when `hydra`."""
    schema.register()
    rundir.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def refused(*overrides: str) -> str:
    """The one line the CLI prints for these overrides (after `expgpu: error: `)."""
    try:
        cfg = composed(*overrides)
        config.check(cfg)
        plain = config.plain(cfg)
        task.resolve(plain["task"])
        placement.compute(plain, plain["launch"]["nproc_per_node"])
    except UserError as e:
        return str(e)
    except Exception as e:   # Hydra's and OmegaConf's: what __main__ turns into one line
        line = _one_line(e)
        assert line is not None, f"{type(e).__name__} would be a traceback: {e}"
        return line
    pytest.fail(f"{overrides} composed and checked without an error")
