"""hydra.launcher.* of gpu_pool read into Settings: the limits' spellings."""

import dataclasses

import pytest

from expgpu.errors import UserError
from expgpu.pool.settings import settings
from hydra_plugins.expgpu_launchers.gpu_pool import GpuPoolLauncherConf


def _params(**changed) -> dict:
    return {**dataclasses.asdict(GpuPoolLauncherConf()), **changed}


@pytest.mark.parametrize("given, limit", [(None, None), (0, None), (0.0, None), (90, 90.0), (0.5, 0.5)])
def test_timeout_min_null_or_0_is_no_limit_as_slurms(given, limit):
    assert settings(_params(timeout_min=given)).timeout_min == limit


@pytest.mark.parametrize("given", [-1, True, float("inf"), "90"])
def test_a_bad_timeout_min_is_one_line_naming_it(given):
    with pytest.raises(UserError, match=r"hydra.launcher.timeout_min=.* is not allowed: minutes > 0 \(e.g. 90 or "
                                        r"0.5\), or 0 or null for no limit"):
        settings(_params(timeout_min=given))
