"""run.wrap's module on several ranks (DDP inside expgpu's Wrapped): the user's own attributes and
methods, DDP's switches set where DDP reads them, and the user's module when it is saved or copied."""

from __future__ import annotations

import copy
import io
import json
import multiprocessing

import pytest
import torch


class Coder(torch.nn.Module):
    """A module with methods of its own besides forward, as a VAE's decode."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(4, 2), torch.nn.Linear(2, 4)

    def forward(self, x, decode: bool = True):
        return self.dec(self.enc(x)) if decode else self.enc(x)

    def decode(self, z):
        return self.dec(z)


def _probe(store: str, out: str) -> None:
    """In a spawned process: run.wrap over a one-process gloo group (DDP, as on several ranks)."""
    import datetime

    import torch.distributed as dist

    from expgpu.distributed import group as expgpu_dist
    from expgpu.distributed.wrap import wrap

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        coder = Coder()
        model = wrap(coder, torch.device("cpu"), "ddp", world_size=2, n_gpus=1)
        ddp = model._forward_module
        # nanoGPT's no_sync shortcut: `model.require_backward_grad_sync = False` on the DDP model
        model.require_backward_grad_sync = False
        model.temperature = 0.5   # a new attribute of the user's own
        buf = io.BytesIO()
        torch.save(model, buf)    # word_language_model saves its best model whole
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        copied = copy.deepcopy(model)
        same = all(torch.equal(a, b) for a, b in zip(coder.state_dict().values(), loaded.state_dict().values()))
        result = {"ddp_flag": ddp.require_backward_grad_sync, "user_has_flag": "require_backward_grad_sync"
                  in coder.__dict__, "temperature": getattr(coder, "temperature", None),
                  "loaded": type(loaded).__name__, "loaded_equal": same, "copied": type(copied).__name__,
                  "copied_is_new": copied is not coder, "decode": model.decode(torch.ones(1, 2)).shape[-1],
                  "isinstance": isinstance(model, Coder) and isinstance(model, torch.nn.Module),
                  "again": [_refused(lambda m=m: wrap(m, torch.device("cpu"), "ddp", world_size=2, n_gpus=1))
                            for m in (model, ddp)],
                  "options": _options_reach_ddp(wrap), "unused": _unused_named(wrap, dist),
                  "bypassed": _bypassed(wrap)}
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
        expgpu_dist._let_gloo_threads_finish()   # or this process may abort at exit (torch 2.13)


def _options_reach_ddp(wrap) -> list:
    model = wrap(Coder(), torch.device("cpu"), "ddp", world_size=2, n_gpus=1,
                 ddp={"static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 1})
    ddp = model._forward_module
    return [ddp.static_graph, ddp.gradient_as_bucket_view, ddp.bucket_bytes_cap]


def _unused_named(wrap, dist) -> list:
    """The forward after a step whose loss left `dec` out, under DDP's two ways of listing it: by index, and by
    name (TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    said = []
    for level in (dist.DebugLevel.OFF, dist.DebugLevel.DETAIL):
        dist.set_debug_level(level)
        model = wrap(Coder(), torch.device("cpu"), "ddp", world_size=2, n_gpus=1)
        model(torch.ones(2, 4), decode=False).sum().backward()
        said.append(_refused(lambda: model(torch.ones(2, 4))))
    dist.set_debug_level(dist.DebugLevel.OFF)
    return said


def _bypassed(wrap) -> dict:
    """What bypassed() says after a step whose loss came from each way of calling the module."""
    from expgpu.distributed.wrap import bypassed, count_forwards

    said = {}
    ways = {"forward": lambda m, x: m(x), "method": lambda m, x: m.decode(m.enc(x)),
            "module": lambda m, x: m.module(x), "no_grad": None}
    for how, call in ways.items():
        model = wrap(Coder(), torch.device("cpu"), "ddp", world_size=2, n_gpus=1)
        model.decode(torch.ones(1, 2))   # before the loop (a sample, say): not counted
        count_forwards([model])
        if call is None:   # a method under no_grad (sampling), no backward: nothing to sync
            with torch.no_grad():
                model.decode(torch.ones(1, 2))
        else:
            call(model, torch.ones(2, 4)).sum().backward()
        said[how] = bypassed(model)
    return said


def _refused(call) -> str | None:
    from expgpu.errors import UserError

    try:
        call()
    except UserError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("wrap")
    proc = multiprocessing.get_context("spawn").Process(target=_probe, args=(str(tmp / "store"), str(tmp / "out")))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    return json.loads((tmp / "out").read_text())


def test_ddps_own_switches_reach_ddp_and_new_attributes_the_users_module(wrapped):
    assert wrapped["ddp_flag"] is False and not wrapped["user_has_flag"]
    assert wrapped["temperature"] == 0.5


def test_saved_or_copied_it_is_the_users_module(wrapped):
    assert wrapped["loaded"] == "Coder" and wrapped["loaded_equal"]
    assert wrapped["copied"] == "Coder" and wrapped["copied_is_new"]
    assert wrapped["decode"] == 4 and wrapped["isinstance"]


def test_a_module_wrapped_already_is_refused_not_wrapped_twice(wrapped):
    # DDP inside DDP would all-reduce every gradient twice, slower and silent
    assert wrapped["again"] == [
        "run.wrap: the module is wrapped already (what run.wrap returned); pass your own module, once",
        "run.wrap: the module is wrapped already (a DistributedDataParallel); pass your own module, once"]


def test_ddps_own_options_reach_ddp(wrapped):
    assert wrapped["options"] == [True, True, 1024 * 1024]


def test_parameters_a_step_left_without_gradient_are_named_in_one_line(wrapped):
    by_index, by_name = wrapped["unused"]
    assert by_index == by_name
    assert by_index.startswith("run.wrap(Coder): on rank 0 the step before this forward gave dec.weight, dec.bias no "
                               "gradient (not used in its loss), and DDP reduces every trainable parameter's gradient")
    assert "run.wrap(model, find_unused_parameters=True) or launch.ddp.find_unused_parameters=true" in by_index


def test_a_first_step_whose_gradients_came_around_ddp_is_said(wrapped):
    said = wrapped["bypassed"]
    assert said["forward"] is None and said["no_grad"] is None
    assert said["method"] == (
        "run.wrap(Coder): the first step gave its parameters gradients with no forward through DDP: model.decode(...) "
        "(a method of Coder, called on what run.wrap returned) runs your module directly, and DDP syncs the gradients "
        "of the forwards it runs only: each rank trains its own copy. Call model(...) for the forward whose loss you "
        "backward (make decode Coder's forward, or call it from forward)")
    assert said["module"].startswith("run.wrap(Coder): the first step gave its parameters gradients with no forward "
                                     "through DDP: model.module(...) or a method of Coder runs your module directly")


def test_ddp_options_are_checked_on_one_rank_as_on_several():
    from expgpu.distributed.wrap import ddp_options
    from expgpu.errors import UserError

    configured = {"find_unused_parameters": False, "static_graph": False, "bucket_cap_mb": None}
    assert ddp_options(configured, {"find_unused_parameters": True}) == {**configured, "find_unused_parameters": True}
    with pytest.raises(UserError, match=r"^run.wrap\(find_unused_parameter=...\): DistributedDataParallel takes no "
                       r"option 'find_unused_parameter' \(did you mean find_unused_parameters\?\); it takes .*"
                       r"static_graph"):
        ddp_options(configured, {"find_unused_parameter": True})
    with pytest.raises(UserError, match=r"^run.wrap\(device_ids=...\): run.wrap sets device_ids itself"):
        ddp_options(configured, {"device_ids": [1]})


def test_modules_no_wrapper_syncs_on_several_ranks_are_named():
    from expgpu.distributed.wrap import unsynced

    model, frozen = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1).requires_grad_(False)
    tracked = {"model": model, "frozen": frozen, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    assert unsynced(tracked, "ddp", 2, wrapped_any=False) == ["model"]   # a frozen one needs no sync
    assert unsynced(tracked, "fsdp", 4, wrapped_any=False) == ["model"]
    assert unsynced(tracked, "ddp", 2, wrapped_any=True) == []    # run.wrap was called
    assert unsynced(tracked, "none", 2, wrapped_any=False) == []  # each rank alone, as asked
    assert unsynced(tracked, "ddp", 1, wrapped_any=False) == []   # one rank: nothing to sync
    # a wrapper of the task's own, tracked: it syncs
    assert unsynced({**tracked, "dp": torch.nn.DataParallel(model)}, "ddp", 2, wrapped_any=False) == []


def test_the_parameters_checksum_ignores_buffers_the_whole_one_does_not(tmp_path):
    from expgpu.checkpoint.state import CheckpointState

    def sums(running_mean: float):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        model[1].running_mean.fill_(running_mean)   # BatchNorm's stats after a rank's last forward
        state = CheckpointState(tmp_path, None, rank=0, world_size=2, device=torch.device("cpu"))
        state.add("model", model)
        return state.checksums()

    (whole_a, weights_a), (whole_b, weights_b) = sums(0.0), sums(1.0)
    assert weights_a == weights_b and whole_a != whole_b
