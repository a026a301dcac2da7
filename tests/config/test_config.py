"""The config in this process (fast tier): what Hydra composes onto expgpu's schema, the range checks,
the task parameters a function takes, and each mistake as the one line the CLI prints.

The CLI end to end (a subprocess per case) is tests/e2e/test_cli.py::test_bad_input_is_one_line_and_exit_2;
here the same stages run in-process: compose -> config.check -> task.resolve -> placement."""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

import pytest
from config_compose import composed, refused

from expgpu import config, task
from expgpu.errors import UserError
from expgpu.task import values

SIM2 = "inventory.simulate=[{name:A100,memory_mb:40960},{name:T4,memory_mb:15360}]"


def test_the_default_config_is_task_a_on_the_sequential_map_with_ddp():
    plain = config.plain(composed())
    assert plain["task"]["model"]["_target_"] == "expgpu.tasks.models.MLP"
    assert (plain["gpu_map"]["strategy"], plain["backend"]["name"], plain["launch"]["wrap"]) == \
        ("sequential", "auto", "ddp")
    assert plain["checkpoint"] == {"every_steps": 0, "resume": True, "poll_every": "auto", "format": "auto",
                                   "async_save": False, "verify": False}
    assert plain["launch"]["fsdp"] == {"units": None, "reshard_after_forward": True, "cpu_offload": False}
    assert plain["logger"]["csv"] == {"file": "metrics.csv"} and plain["logger"]["mlflow"] is None


def test_a_config_is_expgpus_with_its_task_gpu_map_and_launch_sections():
    from omegaconf import OmegaConf

    # expgpu's launchers check and place a job only then; another app's job gets hydra.launcher's keys
    assert config.is_expgpu(composed("task=b"))
    # Hydra's own example apps sweep task=1,2,3: a number, not expgpu's task section
    assert not config.is_expgpu(OmegaConf.create({"task": 1, "gpu_map": {}, "launch": {}}))
    assert not config.is_expgpu(OmegaConf.create({"task": {"lr": 0.1}, "launch": {}}))


def test_groups_and_overrides_land_typed():
    plain = config.plain(composed("task=b", "gpu_map=ranked", "launch.nproc_per_node=2", "checkpoint.poll_every=7",
                                  "logger=[csv,tensorboard]", "objective=[eval_loss,accuracy]"))
    assert plain["gpu_map"]["strategy"] == "ranked" and plain["launch"]["nproc_per_node"] == 2
    assert plain["checkpoint"]["poll_every"] == 7 and plain["objective"] == ["eval_loss", "accuracy"]
    assert plain["logger"]["tensorboard"] == {"dir": "tensorboard"}
    config.check(composed("task=b"))


BAD = {
    "unknown key under a group": (["gpu_map.strategi=ranked"],
                                  "gpu_map.strategi: unknown key; allowed under gpu_map: strategy, gpus, scores"),
    "unknown root key": (["dryrun=true"], "dryrun: unknown key; allowed under the root: task, gpu_map"),
    # Hydra adds a key given with +, and nothing under expgpu's sections would read it
    "a key added under a section": (["+launch.backend=mpi"], "launch.backend: unknown key; allowed under launch: "
                                    "nproc_per_node, nodes, isolation, wrap, fsdp, ddp, stdout, hang, on_hang, "
                                    "max_restarts, exclude_bad_nodes, lease_gpus (a key added with + here is read "
                                    "by nothing)"),
    "a key added deeper": (["+launch.hang.every=5"], "launch.hang.every: unknown key; allowed under launch.hang: "
                                                     "timeout_s, slow_phase_s"),
    "a key added to a chosen logger": (["logger=[csv,tensorboard]", "+logger.tensorboard.flush=2"],
                                       "logger.tensorboard.flush: unknown key; allowed under logger.tensorboard: dir"),
    "enum value": (["launch.isolation=magic"], "launch.isolation"),
    "enum value after a group": (["gpu_map=ranked", "gpu_map.strategy=fastest"], "gpu_map.strategy"),
    "type": (["launch.nproc_per_node=two"], "launch.nproc_per_node"),
    "missing group option": (["task=nope"], "task/nope"),
    "range": (["launch.nproc_per_node=0"], "launch.nproc_per_node=0 is not allowed: an integer >= 1"),
    "poll_every zero": (["checkpoint.poll_every=0"], "checkpoint.poll_every=0 is not allowed: auto or an integer >= 1"),
    "poll_every word": (["checkpoint.poll_every=often"],
                        "checkpoint.poll_every='often' is not allowed: auto or an integer >= 1"),
    "faults half set": (["faults.crash_rank=0"], "set faults.crash_rank and faults.crash_step together"),
    "hang timeout zero": (["launch.hang.timeout_s=0"], "launch.hang.timeout_s=0 is not allowed: auto, a number of "
                                                       "seconds > 0, or null (no watchdog)"),
    "hang timeout negative": (["launch.hang.timeout_s=-5"], "launch.hang.timeout_s=-5 is not allowed: auto"),
    "hang timeout word": (["launch.hang.timeout_s=soon"], "launch.hang.timeout_s='soon' is not allowed: auto"),
    "slow phase zero": (["launch.hang.slow_phase_s=0"], "launch.hang.slow_phase_s=0.0 is not allowed"),
    "on_hang unknown": (["launch.on_hang=retry"], "launch.on_hang"),
    "restart without restarts": (["launch.on_hang=restart"], "launch.on_hang=restart is not allowed: fail, or restart "
                                                             "with launch.max_restarts >= 1"),
    "slow phase without a watchdog": (["launch.hang.timeout_s=null", "launch.hang.slow_phase_s=5"],
                                      "launch.hang.slow_phase_s=5.0 is not allowed: 600 (its default) under "
                                      "launch.hang.timeout_s=null"),
    "restart after a hang without a watchdog": (["launch.on_hang=restart", "launch.max_restarts=1",
                                                 "launch.hang.timeout_s=null"],
                                                "launch.on_hang=restart is not allowed: fail under "
                                                "launch.hang.timeout_s=null"),
    "a key of a logger not chosen": (["logger=csv", "logger.mlflow.experiment=x"],
                                     "logger.mlflow.experiment=x: logger.mlflow is null in this config, so nothing "
                                     "under it can be set; choose that logger too, e.g. logger=[csv,mlflow], or "
                                     "drop the key"),
    "a key under a null list": (["inventory.simulate.0.name=x"], "inventory.simulate.0.name=x: inventory.simulate is "
                                "null in this config, so nothing under it can be set; set inventory.simulate itself"),
    "nodes zero": (["launch.nodes=0"], "launch.nodes=0 is not allowed: an integer >= 1"),
    "max_restarts negative": (["launch.max_restarts=-1"], "launch.max_restarts=-1 is not allowed: an integer >= 0"),
    "dp with ranks": (["launch.wrap=dp", "launch.nproc_per_node=2"], "launch.wrap=dp is not allowed"),
    "ddp's option under fsdp": (["launch.wrap=fsdp", "launch.ddp.find_unused_parameters=true"],
                                "launch.ddp.find_unused_parameters=true is not allowed: set only with launch.wrap=ddp"),
    "ddp's option misspelt": (["launch.ddp.find_unused=true"], "launch.ddp.find_unused: unknown key; allowed under "
                              "launch.ddp: find_unused_parameters, static_graph, gradient_as_bucket_view, "
                              "bucket_cap_mb"),
    "ddp's bucket size": (["launch.ddp.bucket_cap_mb=0"], "launch.ddp.bucket_cap_mb=0.0 is not allowed: null (DDP's "
                                                          "own, 25) or megabytes > 0"),
    "objective type": (["objective=3"], "objective=3 is not allowed"),
    "task key misspelt": (["task.batch_sise=3"], "task.batch_sise: expgpu.tasks.supervised.train takes no parameter "
                                                 "'batch_sise' (did you mean task.batch_size?)"),
    "task key nested": (["task.lr=0.1"], "takes no parameter 'lr' (did you mean task.optimizer.lr?)"),
    "task value": (["task.batch_size=abc"], "task.batch_size"),
    "custom gpus twice": (["gpu_map=custom", "gpu_map.gpus=[0,0]", "launch.nproc_per_node=2", SIM2], "gpu_map.gpus"),
    "custom gpu missing": (["gpu_map=custom", "gpu_map.gpus=[5]", SIM2], "gpu_map.gpus"),
    "simulated gpu without memory": (["inventory.simulate=[{name:A100}]"], "inventory.simulate[0].memory_mb"),
    "weights under uniform batches": (["data.weights=[3,1]"], "data.weights=[3.0, 1.0] is not allowed: null under "
                                                            "data.shard=uniform"),
    "a strategy's key under another": (["gpu_map.min_free_mb=2000"], "gpu_map.min_free_mb=2000 is read by "
                                                                     "gpu_map=free_memory only"),
}


@pytest.mark.parametrize("overrides, needle", BAD.values(), ids=BAD.keys())
def test_each_mistake_is_one_line_naming_it(overrides, needle):
    line = refused(*overrides)
    assert needle in line and "\n" not in line, line


def test_hydras_advice_to_append_a_key_is_given_at_the_root_only():
    # inside a section the key it would add is read by nothing (and refused, above)
    assert "(to append to your config use +dryrun=true)" in refused("dryrun=true")
    assert "+" not in refused("gpu_map.strategi=ranked")


def test_a_new_key_at_the_root_is_kept_as_a_note_of_the_run():
    cfg = composed("+note=baseline", "+tags.owner=ana", "gpu_map=ranked", "+gpu_map.scores.0=2.5")
    config.check(cfg)
    assert (cfg.note, cfg.tags.owner, list(cfg.gpu_map.scores.values())) == ("baseline", "ana", [2.5])


# -- task parameters: what a function of one's own is given -------------------------------------

class Opt(enum.Enum):
    adam = "adam"
    sgd = "sgd"


def typed(run, lr: float = 1e-3, layers: list[int] = (8,), betas: tuple[float, float] = (0.9, 0.99),
          kind: Literal["mlp", "cnn"] = "mlp", opt: Opt = Opt.adam, max_steps: int = 10, seed: int = 0):
    return None


@dataclasses.dataclass
class ModelCfg:
    n_layer: int = 2
    dropout: float = 0.0


@dataclasses.dataclass
class GPTConfig:
    lr: float = 6e-4
    batch_size: int = 12
    model: ModelCfg = dataclasses.field(default_factory=ModelCfg)
    seed: int = 1337


def configured(run, cfg: GPTConfig):
    return None


class Block:
    def __init__(self, width: int, depth: int = 2):
        self.width, self.depth = width, depth


class Loose:
    def __init__(self, width: int, **extra):
        self.width, self.extra = width, extra


def built(run, model=None):
    return None


HERE = __name__


def spec(**keys):
    return task.resolve({"_target_": f"{HERE}.{keys.pop('fn', 'typed')}", "_partial_": True, **keys})


def test_values_are_converted_to_the_annotations_and_run_keys_reach_the_function():
    s = spec(lr="2e-3", layers=[4, "5"], betas=[0.8, 0.9], kind="cnn", opt="sgd", seed=7, log_every=5)
    assert s.params == {"lr": 2e-3, "layers": [4, 5], "betas": (0.8, 0.9), "kind": "cnn", "opt": Opt.sgd, "seed": 7}
    assert (s.seed, s.log_every, s.seed_per_rank, s.precision) == (7, 5, True, "32")


def test_the_length_and_logging_keys_do_not_change_what_a_checkpoint_must_match():
    base = spec(lr=1e-3)
    assert spec(lr=1e-3, max_steps=99, log_every=3).fingerprint == base.fingerprint
    assert spec(lr=2e-3).fingerprint != base.fingerprint
    assert spec(lr=1e-3, seed=1).fingerprint != base.fingerprint


def test_a_config_object_takes_the_task_keys_as_its_fields():
    s = spec(fn="configured", lr=1e-3, model={"n_layer": "4"}, seed=3)
    built = values.built_object(s.config_object[1], s.params)
    assert built == GPTConfig(lr=1e-3, model=ModelCfg(n_layer=4), seed=3)


TASK_MISTAKES = {
    "misspelt": ({"lrr": 1}, f"task.lrr: {HERE}.typed takes no parameter 'lrr' (did you mean task.lr?)"),
    "type": ({"lr": "fast"}, "task.lr='fast'"),
    "list element": ({"layers": ["a"]}, "task.layers[0]='a' is not allowed"),
    "literal": ({"kind": "rnn"}, "task.kind='rnn'"),
    "enum": ({"opt": "lbfgs"}, "task.opt='lbfgs'"),
    "partial false": ({"_partial_": False}, "task._partial_=false"),
    "precision": ({"precision": "fp8"}, "task.precision"),
    "field": ({"fn": "configured", "lrr": 1}, f"task.lrr: {HERE}.configured takes its parameters as cfg: "
                                              "GPTConfig has no field 'lrr' (did you mean task.lr?)"),
    "nested field": ({"fn": "configured", "model": {"n_layers": 4}}, "task.model.n_layers"),
    "no such function": ({"fn": "nothing"}, "has no attribute 'nothing'"),
}


@pytest.mark.parametrize("keys, needle", TASK_MISTAKES.values(), ids=TASK_MISTAKES.keys())
def test_a_task_key_the_function_cannot_take_is_one_line(keys, needle):
    with pytest.raises(UserError) as caught:
        spec(**keys)
    assert needle in str(caught.value), str(caught.value)


def test_a_target_entrys_key_its_callable_does_not_take_is_one_line_with_what_it_takes():
    s = spec(fn="built", model={"_target_": f"{HERE}.Block", "widht": 3})
    with pytest.raises(UserError) as caught:
        task.build_params(s)
    assert str(caught.value) == (f"task.model.widht: {HERE}.Block takes no parameter 'widht' (did you mean "
                                 "task.model.width?); it takes width, depth")
    ok = task.build_params(spec(fn="built", model={"_target_": f"{HERE}.Block", "width": 3}))["model"]
    assert (ok.width, ok.depth) == (3, 2)
    # a callable that takes **kwargs checks its own keys: built as given
    loose = task.build_params(spec(fn="built", model={"_target_": f"{HERE}.Loose", "width": 3, "widht": 4}))
    assert loose["model"].extra == {"widht": 4}


def test_a_script_tasks_output_watch_finds_hangs_to_restart_after_without_the_watchdog():
    # task.output_timeout_s (a script task's) judges hangs on its own: on_hang=restart means something there
    config.check(composed("+task.output_timeout_s=30", "launch.on_hang=restart", "launch.max_restarts=1",
                          "launch.hang.timeout_s=null"))


def test_the_built_in_loop_unwrapped_on_several_ranks_is_refused_once_the_world_is_counted():
    def world(n: int, *overrides: str, script: dict | None = None) -> None:
        config.check_world({**config.plain(composed("launch.wrap=none", *overrides)), "script": script}, n)

    world(1)   # one rank: nothing to sync
    world(4, "task._target_=builtins.print")   # a function task keeps its own ranks in step (or not)
    world(4, script={"argv": ["train.py"]})     # so does a script (script.prepare's plain["script"])
    with pytest.raises(UserError, match=r"^launch.wrap=none on 4 ranks: the built-in loop would train 4 separate"):
        world(4)   # e.g. srun's 4 tasks, which launch.nproc_per_node=1 does not show
