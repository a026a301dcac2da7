"""expgpu.pool.compose (fast tier): a sweep job's config composed once per choice of config groups is the
config Hydra's load_sweep_config composes for it, override kind by kind, and a mistake is Hydra's error.

Each case composes the same job both ways, from the same master config, and compares the whole config
(the hydra node too) as YAML, with its flags; the loader is counted, so a case that quietly fell back
to Hydra's path fails the speed half of the promise, not only the equal half."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import OmegaConf

from expgpu import rundir, schema
from expgpu.__main__ import conf_dir
from expgpu.pool import compose

SWEEP = ["hydra/launcher=gpu_pool", "hydra.sweep.dir=/tmp/x", "hydra.job.config.override_dirname.exclude_keys=[seed]"]


class Counting:
    """Hydra's loader, counting its full compositions."""

    def __init__(self, loader):
        self.loader = loader
        self.calls = {"load_sweep_config": 0, "load_configuration": 0}

    def __getattr__(self, name):
        attr = getattr(self.loader, name)
        if name in self.calls:
            def counted(*a, **k):
                self.calls[name] += 1
                return attr(*a, **k)
            return counted
        return attr


@pytest.fixture
def loader():
    schema.register()
    rundir.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()
    GlobalHydra.instance().clear()


def master_of(loader, *hydra_overrides: str):
    return loader.load_configuration("config", [*SWEEP, *hydra_overrides], RunMode.MULTIRUN)


def same(loader, master, counting, overrides: list[str]) -> None:
    ours = compose.sweep_config(counting, master, overrides)
    hydras = loader.load_sweep_config(master, overrides)
    assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(hydras), overrides
    for node in ("", "hydra", "task"):
        a, b = (OmegaConf.select(c, node) if node else c for c in (ours, hydras))
        assert (OmegaConf.is_struct(a), OmegaConf.is_readonly(a)) == (OmegaConf.is_struct(b), OmegaConf.is_readonly(b))


JOBS = [
    # what a search's trials differ in: values (as Hydra parses them), the trial's file (a force-add)
    ["task.optimizer.lr=0.001", "task.batch_size=32", "task=digits", "++hydra.job.env_set.EXPGPU_TRIAL=/s/0.json"],
    ["task.optimizer.lr=3e-1", "task.batch_size=8", "task=digits", "++hydra.job.env_set.EXPGPU_TRIAL=/s/1.json"],
    ["task.optimizer.lr=0.5", "task.batch_size=64", "task=digits", "++hydra.job.env_set.EXPGPU_TRIAL=/s/2.json"],
    # another group choice, and a group added; a seed the dirname leaves out
    ["task=b", "task.seed=3", "task.max_steps=7"],
    ["task=b", "task.seed=4", "task.max_steps=9"],
    ["task=a", "task.seed=1", "launch.nproc_per_node=2"],
    # every kind of value override: add, force-add, delete, dict, list, null, quoted, interpolation
    ["+extra=1", "++task.seed=5", "~task.eval_every", "task.model={_target_:x.Y,hidden:8}",
     "hydra.job.config.override_dirname.exclude_keys=[task.seed]", "task.name=null", "objective='a b'"],
    ["+extra=2", "++task.seed=6", "~task.eval_every", "task.model={_target_:x.Z,hidden:9}",
     "hydra.job.config.override_dirname.exclude_keys=[task.seed]", "task.name=null", "objective='c,d'"],
    ["task.max_steps=${task.seed}", "task.seed=2"],
    # one key twice: the last wins, as in Hydra
    ["task.seed=1", "task.seed=2"],
    ["task.seed=3", "task.seed=4"],
    # what Hydra records itself: composed by Hydra
    ["hydra.job.name=mine", "task.seed=1"],
    ["hydra.job.override_dirname=x", "task.seed=1"],
]


def test_each_kind_of_override_composes_as_hydra_composes_it(loader):
    master = master_of(loader)
    counting = Counting(loader)
    for overrides in JOBS:
        same(loader, master, counting, overrides)
    # Hydra composed the jobs that reach its records, and each choice of groups once, no more
    groups = {("hydra/launcher=gpu_pool", "task=digits"), ("hydra/launcher=gpu_pool", "task=b"),
              ("hydra/launcher=gpu_pool", "task=a"), ("hydra/launcher=gpu_pool",)}
    assert counting.calls == {"load_sweep_config": 2, "load_configuration": len(groups)}


def test_a_sweep_with_env_copy_or_a_search_path_is_composed_by_hydra(loader):
    for extra in (["hydra.job.env_copy=[HOME]"], ["hydra.searchpath=[pkg://expgpu]"]):
        master = master_of(loader, *extra)
        counting = Counting(loader)
        for overrides in JOBS[:3]:
            same(loader, master, counting, overrides)
        assert counting.calls["load_sweep_config"] == 3


@pytest.mark.parametrize("overrides", [["checkpoint.every_steps=abc"], ["gpu_map.no_such_key=1"], ["task=no_such_task"],
                                       ["+task.seed=1"], ["~task.no_such_key"], ["task.seed=1,2"]])
def test_a_mistake_is_hydras_own_error(loader, overrides):
    master = master_of(loader)
    compose.sweep_config(loader, master, ["task.seed=1"])   # the composer has a base already
    with pytest.raises(Exception) as hydras:
        loader.load_sweep_config(master, overrides)
    with pytest.raises(type(hydras.value)) as ours:
        compose.sweep_config(loader, master, overrides)
    assert str(ours.value) == str(hydras.value)
    assert isinstance(hydras.value, ConfigCompositionException) or overrides == ["task=no_such_task"]


def test_each_job_gets_a_config_of_its_own(loader, tmp_path, monkeypatch):
    master = master_of(loader)
    a = compose.sweep_config(loader, master, ["task.seed=1"])
    monkeypatch.chdir(tmp_path)   # Hydra records the cwd of each job's composition
    b = compose.sweep_config(loader, master, ["task.seed=2"])
    assert b.hydra.runtime.cwd == str(tmp_path) != a.hydra.runtime.cwd
    a.task.max_steps = 12345
    assert (a.task.seed, b.task.seed) == (1, 2) and b.task.max_steps != 12345
    assert list(b.hydra.overrides.task) == ["task.seed=2"] and b.hydra.job.override_dirname == "task.seed=2"


def test_the_sweepers_check_of_a_batch_is_answered_by_the_composer_with_hydras_config_and_errors(loader, monkeypatch):
    # Hydra's sweepers compose every job once more to check a batch (validate_batch_is_legal, through the
    # launcher's loader): at an expgpu launcher's set-up that loader answers with sweep_config.
    master = master_of(loader)
    wanted = [OmegaConf.to_yaml(loader.load_sweep_config(master, job)) for job in JOBS[:6]]
    compose.answer_checks(loader)
    compose.answer_checks(loader)   # a second launcher's set-up: no stand-in for the stand-in
    assert type(vars(loader)["load_sweep_config"]) is compose._Checks
    full = []
    hydras = type(loader).load_configuration
    monkeypatch.setattr(type(loader), "load_configuration",
                        lambda self, *a, **k: full.append(a) or hydras(self, *a, **k))
    got = [OmegaConf.to_yaml(loader.load_sweep_config(master_config=master, sweep_overrides=job)) for job in JOBS[:6]]
    assert got == wanted
    assert len(full) == 3   # once per choice of groups (task=digits, b, a), not once per job
    with pytest.raises(ConfigCompositionException) as caught:   # a mistake: Hydra's own error
        loader.load_sweep_config(master_config=master, sweep_overrides=["gpu_map.no_such_key=1"])
    assert "no_such_key" in str(caught.value)


def test_gpu_pools_launch_takes_the_checked_config_instead_of_composing_the_job_again(loader, monkeypatch):
    """answer_checks(keep=True), gpu_pool's: each config the sweeper's check composed is the one its launch
    gets for those overrides, once; a job the check did not see (or a second launch of it) is composed."""
    master = master_of(loader)
    compose.answer_checks(loader, keep=True)
    checked = [loader.load_sweep_config(master, job) for job in JOBS[:3]]   # the sweeper's check (Hydra drops them)
    made = []
    composing = compose._Composer.__call__
    monkeypatch.setattr(compose._Composer, "__call__", lambda self, o: made.append(o) or composing(self, o))
    launched = [compose.sweep_config(loader, master, job) for job in JOBS[:3]]
    assert all(a is b for a, b in zip(launched, checked)) and made == []
    again = compose.sweep_config(loader, master, JOBS[0])
    assert again is not checked[0] and made == [JOBS[0]]
    assert OmegaConf.to_yaml(again) == OmegaConf.to_yaml(checked[0])


@pytest.mark.parametrize("subdir, want", [
    (["hydra.sweep.subdir=${hydra.job.num}"], "7"),   # Hydra's and expgpu's default
    (["hydra.sweep.subdir=${hydra:job.num}_${hydra:job.override_dirname}"], "7_task.seed=3"),
    (["+mine=${hydra:job.num}", "hydra.sweep.subdir=${mine}"], "7"),   # a ${hydra:...} reached through a key
])
def test_a_jobs_dir_is_the_one_run_job_computes(loader, subdir, want):
    """job_dir resolves the sweep dir as run_job will, with the job's own config as HydraConfig where the
    dir reads it, and leaves the launcher's HydraConfig as it was."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from expgpu.pool.job_config import job_dir

    master = master_of(loader)
    cfg = compose.sweep_config(loader, master, [*subdir, "task.seed=3"])
    with open_dict(cfg):
        cfg.hydra.job.num = cfg.hydra.job.id = 7
    HydraConfig.instance().set_config(master)   # the launcher's, as Hydra sets it
    before = HydraConfig.instance().cfg
    assert job_dir(cfg) == Path("/tmp/x") / want
    assert HydraConfig.instance().cfg is before


def test_a_jobs_config_is_read_in_the_launcher_as_the_job_will_read_it(loader):
    """in_job/resolved: ${hydra:job.num} and ${hydra:runtime.output_dir} resolve to the job's own values (its
    config as HydraConfig, what run_job fills in filled in for the read), hydra.job.id stands in where the
    launcher does not know it (a SLURM job's), and neither the job's config nor the launcher's HydraConfig is
    changed after it."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from expgpu.pool.job_config import in_job, resolved

    master = master_of(loader, "hydra.sweep.subdir=run_${hydra.job.num}")
    cfg = compose.sweep_config(loader, master, ["task.seed=${hydra:job.num}", "+task.out=${hydra:runtime.output_dir}",
                                                "+task.tag=${hydra:job.id}"])
    with open_dict(cfg):
        cfg.hydra.job.num = 7
    HydraConfig.instance().set_config(master)   # the launcher's, as Hydra sets it
    before = HydraConfig.instance().cfg
    task = resolved(cfg, "task")
    assert (task["seed"], task["out"], task["tag"]) == (7, "/tmp/x/run_7", "job_id_for_7")
    assert HydraConfig.instance().cfg is before
    assert OmegaConf.is_missing(cfg.hydra.runtime, "output_dir") and OmegaConf.is_missing(cfg.hydra.job, "id")
    assert not OmegaConf.is_readonly(cfg.hydra)   # the job's process still sets what run_job sets
    assert in_job(cfg, lambda c: c.hydra.job.num) == 7   # a read that needs nothing is made on cfg itself


def test_a_read_that_fails_on_the_jobs_own_config_raises_its_error(loader):
    """A bad value is the job's error, raised with the job's HydraConfig, not the launcher's missing one."""
    from omegaconf import open_dict
    from omegaconf.errors import InterpolationResolutionError

    from expgpu.pool.job_config import resolved

    cfg = compose.sweep_config(loader, master_of(loader), ["+task.x=${hydra:job.num}_${oc.env:EXPGPU_NO_SUCH_VAR}"])
    with open_dict(cfg):
        cfg.hydra.job.num = 0
    with pytest.raises(InterpolationResolutionError) as raised:
        resolved(cfg, "task")
    assert "HydraConfig was not set" not in str(raised.value) and "EXPGPU_NO_SUCH_VAR" in str(raised.value)


def test_only_a_large_batchs_configs_are_frozen_for_the_collector_and_thawed_by_the_pool(monkeypatch):
    """settle(n) freezes from the SETTLE_FROM-th job of a batch on (its first collection walks the whole process:
    an optimizing sweeper's batches of n_jobs must not pay it); thaw() unfreezes only what it froze."""
    import gc

    def frozen(obj) -> bool:   # in the collector's permanent generation (get_objects() lists the others)
        return not any(o is obj for o in gc.get_objects())

    # By what is frozen, not by gc.get_freeze_count(): a frozen object that is freed leaves the count
    monkeypatch.setattr(compose, "_frozen", False)
    theirs = [[]]
    gc.freeze()   # what another part of the process froze
    ours = [[]]   # made after that freeze: frozen by a settle that freezes
    compose.settle(compose.SETTLE_FROM - 1)
    assert frozen(theirs) and not frozen(ours)
    compose.thaw()   # froze nothing: leaves the other part's frozen
    assert frozen(theirs) and not frozen(ours)
    try:
        compose.settle(compose.SETTLE_FROM)
        assert frozen(ours)
    finally:
        compose.thaw()
    assert not frozen(theirs) and not frozen(ours)
    assert gc.get_freeze_count() == 0


def test_an_override_is_parsed_once_for_every_job_that_repeats_it_but_shuffle_each_time(loader, monkeypatch):
    from collections import Counter

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parse = OverridesParser.parse_overrides
    parsed: list[str] = []
    monkeypatch.setattr(OverridesParser, "parse_overrides",
                        lambda self, overrides: parsed.extend(overrides) or parse(self, overrides))
    master = master_of(loader)
    counting = Counting(loader)
    jobs = [["task.model={_target_:x.Y,hidden:8}", "+extra=[1,2]", "task.seed=1"],
            ["task.model={_target_:x.Y,hidden:8}", "+extra=[1,2]", "task.seed=2"]]
    for overrides in jobs * 2:   # a dict and a list parsed once, as Hydra parses them, and never changed by a job
        same(loader, master, counting, overrides)
    hydras = Counter(o for job in jobs * 2 for o in job)   # Hydra's: each job parses its own
    assert Counter(o for o in parsed if o in hydras) == hydras + Counter(hydras.keys())   # ours: each spelling once
    orders = {tuple(compose.sweep_config(loader, master, ["+order=shuffle([1,2,3,4,5,6,7,8,9,10])"]).order)
              for _ in range(4)}
    assert len(orders) > 1
