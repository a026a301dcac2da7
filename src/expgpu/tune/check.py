"""In a trial's job, before the task runs: the parameters the study records for the trial are the
ones the job composed. A study that learns from values that never ran is a silently wrong search
(a key both searched and set elsewhere, a launcher that dropped an override): the job fails at once
instead, naming the key, and the sweeper stops with that line (a UserError, exit 2).

The sweeper hands the launcher its task function wrapped in TrialChecked; a job that is not a trial
(no TRIAL_ENV) runs the task as it is. Picklable (a class, not a closure): joblib, submitit and gpu_pool
send the task function to other processes.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

from expgpu.errors import UserError
from expgpu.tune import TRIAL_ENV

_ABSENT = object()


class TrialMismatch(UserError):
    pass


class TrialChecked:
    def __init__(self, task_function):
        # its name, module and __wrapped__ (what gpu_pool looks at), not its attributes: a callable
        # object's would shadow ours
        functools.update_wrapper(self, task_function, updated=())
        self._task_function = task_function

    def __call__(self, cfg):
        path = os.environ.get(TRIAL_ENV)
        if path:
            trial = json.loads(Path(path).read_text())
            check(cfg, trial.get("params") or {})
        return self._task_function(cfg)


def check(cfg, params: dict[str, Any]) -> None:
    """Raise TrialMismatch at the first parameter whose composed value differs from the trial's."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    for name, value in params.items():
        key = name.lstrip("+")
        composed = composed_value(cfg, hydra, key)
        if composed is _ABSENT:
            raise TrialMismatch(f"the study records {name}={value!r}, but the job's config has no {key}; a "
                                "custom_search_space parameter must name a config key (+key to add one)")
        if not same(value, composed):
            raise TrialMismatch(f"the study records {name}={value!r}, but the job composed {key}={composed!r}: the key "
                                "is set after the trial's own override too (on the command line, say), and a searched "
                                "key must be set nowhere else, or the study learns from a value that never ran")


def composed_value(cfg, hydra, key: str) -> Any:
    """A key's value in the job: a config group's chosen option, a hydra.* key, or a config key."""
    from omegaconf import OmegaConf

    if hydra is not None and key in hydra.runtime.choices:
        return hydra.runtime.choices[key]
    if key.startswith("hydra.") and hydra is not None:   # the task's cfg has no hydra node
        node = OmegaConf.select(hydra, key[len("hydra."):], default=_ABSENT)
    else:
        node = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
    if isinstance(node, enum.Enum):
        return node.name
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def same(recorded: Any, composed: Any) -> bool:
    if isinstance(recorded, bool) or isinstance(composed, bool):
        return type(recorded) is type(composed) and recorded == composed
    if isinstance(recorded, (int, float)) and isinstance(composed, (int, float)):
        return math.isclose(recorded, composed, rel_tol=1e-12, abs_tol=0.0) or recorded == composed
    return recorded == composed
