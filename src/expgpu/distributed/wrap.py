"""`run.wrap(module)`: the module on its device, wrapped for the world it trains in.

DDP across ranks (device_ids for CUDA), DataParallel over one rank's GPUs, or nothing. What the
user gets back from DDP is not DDP itself but `Wrapped`, as with Lightning Fabric's module: calling
it (the forward, and so the backward) goes through DDP, while every other attribute and method is
the user's own module's (`model.init_hidden(b)`, `model.config`, `model.generate(...)`), so a
script's code keeps working unchanged. `model.module` is the user's module too, for code written
against DDP. Its state_dict has no wrapper prefix, and saved whole (torch.save(model)) or copied it
is the user's module.
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
from typing import Any

# DDP's arguments that run.wrap sets itself: the module, this rank's device, the run's process group.
SET_BY_WRAP = ("module", "device_ids", "output_device", "process_group", "device_mesh")
# The start of DDP's error at the forward after a step whose backward left some parameter without a gradient
# (torch/csrc/distributed/c10d/reducer.cpp), and the line of it that lists them, by index or, under
# TORCH_DISTRIBUTED_DEBUG=DETAIL, by name.
_UNREDUCED = "Expected to have finished reduction in the prior iteration"
_NO_GRAD = re.compile(r"(Parameter indices|Parameters) which did not receive grad for rank (\d+): ([^\n]*)")


def wrap(model, device, mode: str, world_size: int, n_gpus: int, fsdp: dict | None = None, precision: str = "32",
         ddp: dict | None = None):
    """`model` (already on `device`) as launch.wrap says; what the training loop should call.
    fsdp: launch.fsdp's settings (expgpu.distributed.fsdp), for mode fsdp; ddp: DDP's own keyword arguments
    (ddp_options), for mode ddp on several ranks."""
    import torch

    _refuse_wrapped(model)
    if mode == "fsdp":
        from expgpu.distributed import fsdp as fsdp_wrap

        return fsdp_wrap.shard(model, device, world_size, dict(fsdp or {}), precision)

    if mode == "dp":
        if device.type == "cuda" and n_gpus > 1:
            return torch.nn.DataParallel(model, device_ids=list(range(n_gpus)))
        return model
    if mode == "ddp" and world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index or 0] if device.type == "cuda" else None
        return wrapped(DistributedDataParallel(model, device_ids=ids, **(ddp or {})), model)
    return model


def ddp_options(configured: dict, given: dict) -> dict:
    """DDP's keyword arguments for one run.wrap call: launch.ddp's (`configured`), the call's own (`given`) over
    them. A name DDP does not take, or one run.wrap sets, is one line on one rank as on several, where no DDP is
    built: a task's first try on one rank shows the typo its run on eight would stop on."""
    from torch.nn.parallel import DistributedDataParallel

    from expgpu.errors import UserError

    takes = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters
             if n != "self" and n not in SET_BY_WRAP]
    for name in given:
        if name in SET_BY_WRAP:
            raise UserError(f"run.wrap({name}=...): run.wrap sets {name} itself (this rank's module, device and "
                            f"process group); leave it out")
        if name not in takes:
            close = difflib.get_close_matches(name, takes, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"run.wrap({name}=...): DistributedDataParallel takes no option {name!r}{hint}; "
                            f"it takes {', '.join(takes)}")
    return {**configured, **given}


def unused_parameters(ddp, error: BaseException) -> BaseException:
    """DDP's error at a step's forward when the step before left parameters without a gradient, as one line that
    names them (DDP's own lists their indices) and says what to do; any other error as it is."""
    from expgpu.errors import UserError

    text = str(error)
    if _UNREDUCED not in text or ddp.find_unused_parameters:   # then DDP's own cause: outputs it could not see
        return error
    cls = type(ddp.module).__name__
    found = _NO_GRAD.search(text)
    if found is None:   # not the message this was written against
        return UserError(f"run.wrap({cls}): {_unused_advice('this rank', 'some parameters')}")
    kind, rank, listed = found.groups()
    # the reducer's indices count the trainable parameters in named_parameters' order, less DDP's ignored ones
    reduced = [n for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ddp.parameters_to_ignore]
    if kind == "Parameters":   # names, in no order: the module's
        listed = {n.strip() for n in listed.split(",")}
        names = [n for n in reduced if n in listed] + sorted(listed - set(reduced) - {""})
    else:
        names = [reduced[int(i)] if int(i) < len(reduced) else f"#{i}" for i in listed.split()]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return UserError(f"run.wrap({cls}): {_unused_advice(f'rank {rank}', shown)}")


def _unused_advice(where: str, what: str) -> str:
    return (f"on {where} the step before this forward gave {what} no gradient (not used in its loss), and DDP "
            f"reduces every trainable parameter's gradient each step: where a step may leave some out (another "
            f"task's head, a branch not taken), run.wrap(model, find_unused_parameters=True) or "
            f"launch.ddp.find_unused_parameters=true (DDP then looks for them after each forward); where they never "
            f"train, p.requires_grad_(False) before run.wrap")


def _refuse_wrapped(model) -> None:
    """A module wrapped already (what run.wrap returned, or a DDP of the user's): wrapped again, DDP inside DDP
    would all-reduce every gradient twice and train on, slower, without a word."""
    import torch

    ours = getattr(model, "_expgpu_wrapped", False)
    if _is_wrapper(model):
        from expgpu.errors import UserError

        what = "what run.wrap returned" if ours else f"a {type(model).__name__}"
        if not ours and not isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            # the task's own fully_shard
            raise UserError(f"run.wrap: the module is sharded already (fully_shard made it {what}); leave run.wrap "
                            "out for it and pass it to run.track as it is, whose checkpoint then keeps every "
                            "rank's shards (checkpoint.format=auto); or leave fully_shard to launch.wrap=fsdp")
        raise UserError(f"run.wrap: the module is wrapped already ({what}); pass your own module, once")


def unsynced(objects: dict, mode: str, world_size: int, wrapped_any: bool) -> list[str]:
    """The names of tracked modules that train with no gradient sync: on several ranks under launch.wrap=ddp or
    fsdp, when run.wrap was never called and no tracked module is a wrapper of the task's own (a DDP, an FSDP
    shard, what run.wrap returned); empty otherwise. Each rank would train its own copy, and the checkpoint
    keep rank 0's."""
    if world_size < 2 or mode not in ("ddp", "fsdp") or wrapped_any:
        return []
    modules = {name: obj for name, obj in objects.items() if hasattr(obj, "named_parameters")}
    if any(_is_wrapper(m) for m in modules.values()):
        return []
    return [name for name, m in modules.items() if any(p.requires_grad for p in m.parameters())]


def _is_wrapper(module) -> bool:
    """A DDP, a DataParallel, an FSDP shard (fully_shard's class) or what run.wrap returned."""
    import torch

    kinds = [torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")   # imported where a module was sharded: not to import here
    if fsdp is not None:                               # (torch.distributed.tensor's import: ~0.5 s of a start)
        kinds.append(fsdp.FSDPModule)
    return getattr(module, "_expgpu_wrapped", False) or isinstance(module, tuple(kinds))


def wrapped(forward_module, original) -> Any:
    """A `Wrapped` whose calls go through `forward_module` (DDP) and whose attributes are `original`'s."""
    return _wrapped_class()(forward_module, original)


_CLASS = None


def _wrapped_class() -> type:
    """Defined on first use: this module must not import torch when expgpu starts (launchers)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import torch

    class Wrapped(torch.nn.Module):
        """The user's module, called through DDP. Attribute lookup: this wrapper's own (the DDP
        module, registered as a child so that parameters(), train(), to() reach the one set of
        parameters), then the user's module, then DDP's (no_sync, join)."""

        def __init__(self, forward_module, original):
            super().__init__()
            self._forward_module = forward_module
            object.__setattr__(self, "_original_module", original)   # not a second child: once in parameters()
            # forwards through DDP, and the names of the user's methods called on it, since the loop began (bypassed)
            object.__setattr__(self, "_expgpu_calls", 0)
            object.__setattr__(self, "_expgpu_methods", set())
            self._expgpu_wrapped = True

        @property
        def module(self):
            return self._original_module

        def forward(self, *args, **kwargs):
            self.__dict__["_expgpu_calls"] += 1
            try:
                return self._forward_module(*args, **kwargs)
            except RuntimeError as e:   # DDP's about parameters that got no gradient: one line naming them
                error = unused_parameters(self._forward_module, e)
                if error is e:
                    raise
                raise error from None

        # The user's names, without a wrapper prefix: parameter groups built from them (no weight
        # decay on biases), and the checkpoint, read as the script wrote them.
        def named_parameters(self, *args, **kwargs):
            return self._original_module.named_parameters(*args, **kwargs)

        def named_buffers(self, *args, **kwargs):
            return self._original_module.named_buffers(*args, **kwargs)

        def state_dict(self, *args, **kwargs):
            return self._original_module.state_dict(*args, **kwargs)

        def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
            return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)   # parameters, buffers, children of the wrapper itself
            except AttributeError:
                pass
            original = self.__dict__["_original_module"]
            if hasattr(original, name):
                found = getattr(original, name)
                if inspect.ismethod(found):   # it runs the user's module directly, outside DDP (bypassed)
                    self.__dict__["_expgpu_methods"].add(name)
                return found
            return getattr(super().__getattr__("_forward_module"), name)

        def __setattr__(self, name: str, value) -> None:
            # Once built, an attribute of the user's module, or a new one (model.temperature = 0.8),
            # lands on the user's module, where its own methods read it; one that only DDP has lands
            # on DDP, which reads it (nanoGPT skips the gradient sync of a micro-step with
            # `model.require_backward_grad_sync = False`); the wrapper's own stay the wrapper's.
            if self.__dict__.get("_expgpu_wrapped") and name not in self.__dict__:
                original, forward = self._original_module, self._forward_module
                setattr(forward if not hasattr(original, name) and hasattr(forward, name) else original, name, value)
            else:
                super().__setattr__(name, value)

        # A transparent proxy, as wrapt's ObjectProxy: isinstance(model, YourModel) holds, and
        # torch.save(model) or copy.deepcopy(model) give the user's module (pickle checks the class
        # its reduction names against __class__), so a script that saves its model whole loads it
        # back as before, with weights_only=True and its own classes allowed.
        @property
        def __class__(self):
            return type(self.__dict__.get("_original_module", self))

        def __reduce_ex__(self, protocol):
            return self._original_module.__reduce_ex__(protocol)

        def __repr__(self) -> str:
            return f"Wrapped(DDP, {self._original_module!r})"

    _CLASS = Wrapped
    return Wrapped


def count_forwards(modules: list) -> None:
    """From now on (the loop's first step), count each Wrapped's forwards through DDP and the methods called on it."""
    for module in modules:
        module.__dict__.update(_expgpu_calls=0, _expgpu_methods=set())


def bypassed(module) -> str | None:
    """The warning for a module run.wrap wrapped in DDP whose parameters got gradients while no forward went
    through DDP since count_forwards (a step whose loss came from model.compute_loss(...), a method of the user's
    module, or model.module(...)): DDP syncs the gradients of the forwards it runs only, so each rank would train
    its own copy, silently; None otherwise."""
    state = module.__dict__
    if state["_expgpu_calls"] or not any(p.grad is not None for p in module.parameters()):
        return None
    cls = type(state["_original_module"]).__name__
    methods = sorted(state["_expgpu_methods"])
    how = (f"{', '.join(f'model.{m}(...)' for m in methods)} ({'a method' if len(methods) == 1 else 'methods'} "
           f"of {cls}, called on what run.wrap returned)" if methods else f"model.module(...) or a method of {cls}")
    own = f"make {methods[0]} {cls}'s forward, or call it from forward" if methods else "not model.module(...)"
    return (f"run.wrap({cls}): the first step gave its parameters gradients with no forward through DDP: {how} "
            f"runs your module directly, and DDP syncs the gradients of the forwards it runs only: each rank trains "
            f"its own copy. Call model(...) for the forward whose loss you backward ({own})")


def skips_sync(module) -> bool:
    """Whether `module` can skip the gradient sync of a micro-step (DDP's no_sync, FSDP's)."""
    return hasattr(module, "no_sync") or hasattr(module, "set_requires_gradient_sync")


def no_sync(module):
    """The context of a micro-step whose gradients are kept local until the step's last one."""
    if hasattr(module, "no_sync"):
        return module.no_sync()
    from expgpu.distributed import fsdp

    return fsdp.no_sync(module)


def unwrapped(obj: Any) -> Any:
    """The user's module inside Wrapped / DDP / DataParallel / torch.compile: what a checkpoint
    saves (its state_dict has no wrapper prefix)."""
    for _ in range(4):
        inner = (getattr(obj, "__dict__", {}).get("_original_module") or getattr(obj, "_orig_mod", None)
                 or (getattr(obj, "module", None) if type(obj).__name__ in ("DistributedDataParallel", "DataParallel")
                     else None))
        if inner is None:
            return obj
        obj = inner
    return obj
