"""A sweep job's config, as Hydra's own launchers compose it (ConfigLoader.load_sweep_config), with the
part that depends only on the job's config-group choices done once per sweep for each choice.

Hydra composes every job from scratch in three parts: (1) read and merge the config files its groups
choose (task=a, hydra/launcher=gpu_pool: the defaults list), (2) apply its value overrides
(task.lr=0.1, +x=1, ~y) to that, (3) record what was asked (hydra.overrides, hydra.job.override_dirname,
hydra.runtime). Part 1 is nearly all of the ~70 ms a job costs (the YAML, the merges): gpu_pool composed
a 300-job sweep for ~20 s before its first job started, and an optimizing sweeper's trials paid it on the
cores its running trials train on. Part 1 is the same for every job that chooses the same groups, so here Hydra
does it once for them (load_configuration with only the group overrides), and each job is a copy of that
with parts 2 and 3 done as Hydra does them, with Hydra's own functions.

A job whose overrides reach what part 3 writes (hydra.runtime, hydra.overrides, hydra.job.name, ...)
or the search path, a config with hydra.job.env_copy, and any job this path cannot compose are composed
by Hydra itself: its error, if any, is Hydra's. tests/pool/test_compose.py checks that both agree, override
kind by kind. The config files are read once per sweep for each choice of groups (gpu_pool composed a
whole batch up front before this too): a file edited mid-sweep does not change a study's later trials.
Hydra's sweepers compose each job once more to check a batch; answer_checks has that done the same way.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import pickle
from typing import Any, Sequence

# What Hydra writes after the value overrides (part 3), or reads before them (the search path): a job's
# override at, above or below one of these is composed by Hydra.
_RECORDS = ("hydra.searchpath", "hydra.runtime", "hydra.overrides", "hydra.job.name", "hydra.job.override_dirname",
            "hydra.job.config_name", "hydra.job.env_copy")
_KEPT = 4   # sweeps' composers a process keeps (one per master config: a sweep)
_CHECKED = 100_000   # checked configs a composer keeps for its launcher (answer_checks' keep)
SETTLE_FROM = 200    # jobs of a batch from which each composed config is frozen for the collector (settle)
_frozen = False      # whether settle() froze what is in the collector's permanent generation

_composers: dict[int, "_Composer"] = {}
log = logging.getLogger("expgpu.pool")


def sweep_config(loader, master, overrides: Sequence[str], keep: bool = False):
    """What loader.load_sweep_config(master, overrides) returns, composed once per choice of groups.
    keep: a sweeper's check of the job, whose config the launcher that asked for it (gpu_pool) takes
    here next instead of composing it again; else a check's config kept for these overrides, if any."""
    composer = _composers.get(id(master))
    if composer is None or composer.master is not master or composer.loader is not loader:
        composer = _composers[id(master)] = _Composer(loader, master)
        while len(_composers) > _KEPT:
            del _composers[next(iter(_composers))]
    key = tuple(overrides)
    if not keep:
        checked = composer.checked.pop(key, None)
        return checked if checked is not None else composer(list(overrides))
    cfg = composer.checked[key] = composer(list(overrides))
    while len(composer.checked) > _CHECKED:   # a sweeper that checks batches it never launches
        del composer.checked[next(iter(composer.checked))]
    settle(len(composer.checked))
    return cfg


def settle(composed: int) -> None:
    """After the `composed`-th job of a batch: from SETTLE_FROM on, what its composition left behind is
    collected and the rest frozen (gc.freeze), so that the collector's passes while a large batch grows do
    not walk the configs composed before, again and again (~1,200 objects a job: a third of a 1000-job
    batch's composition). Cheap after the first (which walks the whole process, ~0.15 s): each walks only
    what came since the last freeze; a small batch (an optimizing sweeper's n_jobs) is left alone. thaw()
    unfreezes them when the pool ends, so that a sweeper's later batches do not keep the earlier ones."""
    global _frozen
    if composed >= SETTLE_FROM:
        gc.collect()
        gc.freeze()
        _frozen = True


def thaw() -> None:
    """What settle() froze, collectable again once nothing holds it (the pool's end)."""
    global _frozen
    if _frozen:
        gc.unfreeze()
        _frozen = False


def answer_checks(loader, keep: bool = False) -> None:
    """Hydra's sweepers compose every job once more before they launch its batch, to check it
    (Sweeper.validate_batch_is_legal, with the launcher's config loader): ~70 ms a job, 20 s of a
    300-job grid's start on 2 cores. Called at an expgpu launcher's set-up: this sweep's loader answers
    those with sweep_config too, the same config and the same error (Hydra's own, where this path gives
    up) in a tenth of the time. keep: the launcher composes through sweep_config and takes each checked
    config (Hydra drops the check's) instead of composing the job twice."""
    if loader is not None and "load_sweep_config" not in vars(loader):
        loader.load_sweep_config = _Checks(loader, keep)


class _Checks:
    """loader.load_sweep_config, answered by sweep_config (a class, not a closure: the loader travels
    pickled with Hydra's context to a SLURM allocation)."""

    def __init__(self, loader, keep: bool = False):
        self.loader, self.keep = loader, keep

    def __call__(self, master_config, sweep_overrides):
        stop_if_asked("the sweeper checked the batch")
        return sweep_config(self.loader, master_config, sweep_overrides, self.keep)


def stop_if_asked(doing: str) -> None:
    """A Ctrl-C or SIGTERM while a large batch is composed (a 300-job grid: seconds), which the CLI's
    StopSignals kept: acted on now, not after the last job's config; no job has started. SLURM's
    SIGUSR2 waits for the pool, which saves and requeues (expgpu.pool.requeue)."""
    from expgpu.procs import stop_signals

    current = stop_signals.current()
    if current is not None and current.received in ("SIGINT", "SIGTERM"):
        log.info("gpu_pool: %s while %s: no job started", current.received, doing)
        raise KeyboardInterrupt


def _touches_records(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") or r.startswith(key + ".") for r in _RECORDS)


class _Composer:
    def __init__(self, loader, master):
        from omegaconf import OmegaConf

        self.loader, self.master = loader, master
        self.name = master.hydra.job.config_name
        self.hydra_overrides = OmegaConf.to_container(master.hydra.overrides.hydra)
        self.repo = None
        self.groups: dict[str, bool] = {}
        # group overrides -> (the config pickled, or None: copied; its override lists' lengths)
        self.bases: dict[tuple[str, ...], Any] = {}
        self.checked: dict[tuple[str, ...], Any] = {}   # a sweeper's check's configs, until the launcher takes them
        self.parsed: dict[str, Any] = {}   # an override as given -> Hydra's Override for it (_parse)

    def __call__(self, overrides: list[str]):
        try:
            cfg = self._compose(self.hydra_overrides + overrides)
        except Exception:   # Hydra composes it, and says what is wrong if anything is
            cfg = None
        return cfg if cfg is not None else self._hydras(overrides)

    def _hydras(self, overrides: list[str]):
        """Hydra's own composition of the job (its error, if any)."""
        method = self.loader.load_sweep_config
        if isinstance(method, _Checks):   # answer_checks' stand-in: Hydra's is the class's
            return type(self.loader).load_sweep_config(self.loader, self.master, overrides)
        return method(self.master, overrides)

    def _compose(self, every: list[str]):
        from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
        from hydra.types import RunMode
        from omegaconf import OmegaConf

        parsed = self._parse(every)
        self.loader.validate_sweep_overrides_legal(overrides=parsed, run_mode=RunMode.RUN, from_shell=True)
        # Hydra's split (defaults_list.Overrides): a dict value or a key that is no config group is a value
        is_value = [isinstance(o.value(), dict) or not self._is_group(o.key_or_group) for o in parsed]
        values = [o for o, v in zip(parsed, is_value) if v]
        if any(_touches_records(o.key_or_group) for o in values):
            return None
        groups = tuple(o.input_line for o, v in zip(parsed, is_value) if not v)
        if groups not in self.bases:
            self.bases[groups] = self._base(list(groups))
        if self.bases[groups] is None:
            return None
        base, kept = self.bases[groups]
        # a pickled copy loads in a third of a deepcopy's time (~1.4 vs ~4 ms): most of a job's composition
        cfg = pickle.loads(base) if isinstance(base, bytes) else copy.deepcopy(base)
        for name, n in kept.items():   # back to the lists as they were before Hydra recorded `groups`
            recorded = cfg.hydra.overrides[name]
            while len(recorded) > n:
                recorded.pop()
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        # part 3, as ConfigLoaderImpl._load_configuration_impl does it (hydra-core 1.3)
        app = []
        for o in parsed:
            if o.is_hydra_override():
                cfg.hydra.overrides.hydra.append(o.input_line)
            else:
                cfg.hydra.overrides.task.append(o.input_line)
                app.append(o)
        cfg.hydra.runtime.cwd = os.getcwd()
        dirname = cfg.hydra.job.config.override_dirname
        cfg.hydra.job.override_dirname = get_overrides_dirname(overrides=app, kv_sep=dirname.kv_sep,
                                                               item_sep=dirname.item_sep,
                                                               exclude_keys=dirname.exclude_keys)
        cfg.hydra.job.config_name = self.name
        OmegaConf.copy_cache(from_config=self.master, to_config=cfg)   # as load_sweep_config does
        return cfg

    def _parse(self, overrides: list[str]) -> list:
        """Hydra's parse of each override, once per sweep for each spelling: every job repeats the sweep's
        own overrides (hydra/launcher=..., task=..., the hydra.* ones), and Hydra's grammar takes ~0.13 ms an
        override, a third of a job's composition. shuffle() is parsed anew each time (its order is random).
        Parsed overrides are only read (by the checks and the value overrides below), never changed."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        todo = [o for o in dict.fromkeys(overrides) if o not in self.parsed]
        fresh = dict(zip(todo, OverridesParser.create().parse_overrides(overrides=todo))) if todo else {}
        self.parsed.update((o, p) for o, p in fresh.items() if "shuffle(" not in o)
        return [self.parsed[o] if o in self.parsed else fresh[o] for o in overrides]

    def _is_group(self, key: str) -> bool:
        if key not in self.groups:
            if self.repo is None:   # with the primary config's hydra.searchpath, as Hydra's per job
                self.repo = self.loader._parse_overrides_and_create_caching_repo(self.name, [])[1]
            self.groups[key] = self.repo.group_exists(key)
        return self.groups[key]

    def _base(self, groups: list[str]):
        """Hydra's config for the group overrides alone (parts 1 and 3), and how long its override lists
        were before part 3 added them; None where part 3 would also write hydra.job.env_set (env_copy)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.types import RunMode

        cfg = self.loader.load_configuration(config_name=self.name, overrides=groups, run_mode=RunMode.RUN)
        if cfg.hydra.job.env_copy:
            return None
        parsed = OverridesParser.create().parse_overrides(overrides=groups)
        added = {"hydra": sum(o.is_hydra_override() for o in parsed)}
        added["task"] = len(parsed) - added["hydra"]
        try:
            base = pickle.dumps(cfg)
        except Exception:   # a node typed by a class pickle cannot name (a plugin's, loaded by Hydra's scan)
            base = cfg
        return base, {name: len(cfg.hydra.overrides[name]) - added[name] for name in added}
