"""Which GPU(s) each local rank gets: pure functions from (inventory, local world size, params) to a
NodePlan. No I/O, no torch: every strategy is testable on a simulated node.

`params` is the gpu_map config group as a mapping: strategy, gpus, scores, min_free_mb, max_util,
gpus_per_rank, share. GPUs are named by NVML index (what nvidia-smi prints), also after an inherited
CUDA_VISIBLE_DEVICES narrowed the inventory.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Mapping

from expgpu.errors import UserError
from expgpu.gpus.inventory import Gpu

_DEFAULTS = {"strategy": "sequential", "gpus": None, "scores": {}, "min_free_mb": 0, "max_util": 100,
             "gpus_per_rank": 1, "share": False}


@dataclass(frozen=True)
class NodePlan:
    strategy: str
    assignments: tuple[tuple[Gpu, ...], ...]   # per local rank: its GPU(s); () means cpu
    scores: Mapping[int, float] = field(default_factory=dict)  # GPU index -> score used (dry-run table)
    visible: tuple[Gpu, ...] = ()   # the inventory planned from, in CUDA order: set_device ordinals

    def gpus_of(self, local_rank: int) -> tuple[Gpu, ...]:
        if not 0 <= local_rank < len(self.assignments):
            raise UserError(f"local rank {local_rank} is not in this node's plan of {len(self.assignments)} "
                            "local ranks; check LOCAL_RANK and the local world size the launcher set")
        return self.assignments[local_rank]

    def to_dict(self) -> dict:
        """JSON-able, and read back by from_dict: how a parent hands its plan to the local ranks."""
        named = {g.index: g for g in self.visible} | {g.index: g for a in self.assignments for g in a}
        return {"strategy": self.strategy, "assignments": [[g.index for g in a] for a in self.assignments],
                "scores": {str(i): s for i, s in self.scores.items()}, "visible": [g.index for g in self.visible],
                "gpus": [asdict(g) for g in named.values()]}

    @classmethod
    def from_dict(cls, data: Mapping) -> NodePlan:
        gpus = {g["index"]: Gpu(**g) for g in data["gpus"]}
        return cls(data["strategy"], tuple(tuple(gpus[i] for i in a) for a in data["assignments"]),
                   {int(i): float(s) for i, s in data["scores"].items()}, tuple(gpus[i] for i in data["visible"]))


STRATEGIES: dict[str, Callable[[list[Gpu], int, Mapping], NodePlan]] = {}


def plan(gpus: list[Gpu], local_world_size: int, params: Mapping) -> NodePlan:
    """The GPU(s) of every local rank, by gpu_map.strategy. `gpus` is inventory() (CUDA order);
    `params` the gpu_map config as config.plain() gives it (strings, not the schema's enums)."""
    name = params.get("strategy") or "sequential"
    if name not in STRATEGIES:
        raise UserError(f"gpu_map.strategy={name!r}: unknown; allowed: {', '.join(STRATEGIES)}")
    _only_where_read(name, params)
    return STRATEGIES[name](gpus, local_world_size, params)


# Keys that one strategy reads: set away from their defaults under another, they would change nothing
READ_BY = {"scores": "ranked", "min_free_mb": "free_memory", "max_util": "free_memory"}


def _only_where_read(name: str, params: Mapping) -> None:
    for key, reader in READ_BY.items():
        value = params.get(key)
        if reader != name and value is not None and value != _DEFAULTS[key]:
            raise UserError(f"gpu_map.{key}={value!r} is read by gpu_map={reader} only, and this run's strategy is "
                            f"{name}: choose gpu_map={reader} or drop the key"
                            + (" (data.weights=[...] sizes proportional batches)" if key == "scores" else ""))


def _strategy(fn):
    """Register `fn` under its name, validate params, and give every rank the CPU on a GPU-less node.
    gpu_map.gpus, set, narrows every other strategy to the GPUs it lists (custom deals them out itself)."""
    @functools.wraps(fn)
    def run(gpus, local_world_size, params):
        p = _settings(params)
        if not isinstance(local_world_size, int) or local_world_size < 1:
            raise UserError(f"local world size {local_world_size!r}: expected an integer >= 1")
        if not gpus and p["gpus"] is None:
            return NodePlan(fn.__name__, ((),) * local_world_size)
        candidates = list(gpus) if fn.__name__ == "custom" or p["gpus"] is None else _listed(gpus, p["gpus"])
        p["_node"] = list(gpus)   # the whole node: gpu_map.scores may name a GPU left out of gpu_map.gpus
        return replace(fn(candidates, local_world_size, p), visible=tuple(gpus))
    STRATEGIES[fn.__name__] = run
    return run


@_strategy
def sequential(gpus, lws, p):
    """Local rank r gets the r-th GPU in CUDA order (k consecutive ones with gpus_per_rank=k)."""
    return _deal("sequential", gpus, lws, p)


@_strategy
def custom(gpus, lws, p):
    """gpu_map.gpus lists the NVML index of every local rank's GPU (k consecutive per rank)."""
    k, wanted = p["gpus_per_rank"], p["gpus"]
    need, by_index = lws * k, {g.index: g for g in gpus}
    allowed = _span(sorted(by_index))
    if wanted is None:
        raise UserError(f"gpu_map.gpus is not set: strategy=custom needs {need} GPU indices ({k} per local rank), "
                        f"e.g. gpu_map.gpus=[{','.join(map(str, sorted(by_index)[:need]))}]")
    _check_present(gpus, wanted)
    twice = next((i for n, i in enumerate(wanted) if i in wanted[:n]), None)
    if twice is not None and not (p["share"] and k == 1):
        raise UserError(f"gpu_map.gpus={wanted}: GPU {twice} listed twice; give each local rank a different "
                        f"GPU index ({allowed}), or set gpu_map.share=true to share it")
    if len(wanted) < need:
        raise UserError(f"gpu_map.gpus={wanted}: {len(wanted)} indices for {lws} local ranks x {k} GPU(s) "
                        f"per rank; list {need}")
    chosen = [by_index[i] for i in wanted[:need]]   # extra entries are unused, as in ranked's top N
    return NodePlan("custom", tuple(tuple(chosen[r * k:(r + 1) * k]) for r in range(lws)))


@_strategy
def ranked(gpus, lws, p):
    """Best GPU to local rank 0, next to 1, ...: gpu_map.scores, else the simulated score, else
    SM count x max SM clock; ties go to more memory, then the lower index."""
    scores = _scores(p["_node"], p["scores"])
    ordered = sorted(gpus, key=lambda g: (-scores[g.index], -g.memory_total_mb, g.index))
    return _deal("ranked", ordered, lws, p, scores)


@_strategy
def free_memory(gpus, lws, p):
    """Most free memory first, then least busy; skips GPUs below min_free_mb or above max_util."""
    k, low, busy = p["gpus_per_rank"], p["min_free_mb"], p["max_util"]
    usable = [g for g in gpus if g.memory_free_mb >= low and g.utilization <= busy]
    ordered = sorted(usable, key=lambda g: (-g.memory_free_mb, g.utilization, g.index))
    sharing = p["share"] and k == 1 and usable
    if len(usable) < min(lws * k, len(gpus)) and not sharing:
        raise UserError(f"gpu_map.min_free_mb={low} / gpu_map.max_util={busy} leave {len(usable)} of {len(gpus)} "
                        f"GPUs usable, but {lws} local ranks x {k} GPU(s) need {lws * k}; lower "
                        "gpu_map.min_free_mb, raise gpu_map.max_util, start fewer ranks or set gpu_map.share=true")
    return _deal("free_memory", ordered, lws, p, {g.index: float(g.memory_free_mb) for g in gpus})


def _listed(gpus, wanted) -> list[Gpu]:
    """The GPUs gpu_map.gpus names, in its order (sequential deals them so; the others rank them)."""
    _check_present(gpus, wanted)
    twice = next((i for n, i in enumerate(wanted) if i in wanted[:n]), None)
    if twice is not None:
        raise UserError(f"gpu_map.gpus={wanted}: GPU {twice} listed twice; list the GPUs to choose from once "
                        "each (gpu_map.share=true lets ranks share them)")
    by_index = {g.index: g for g in gpus}
    return [by_index[i] for i in wanted]


def _check_present(gpus, wanted) -> None:
    allowed = _span(sorted(g.index for g in gpus))
    for i in wanted:
        if i not in {g.index for g in gpus}:
            where = f"this node has {allowed} only" if gpus else "this node has no GPUs (NVML or the mask)"
            raise UserError(f"gpu_map.gpus={wanted}: asks for GPU {i} but {where}")


def _deal(name, ordered, lws, p, scores=None) -> NodePlan:
    """Hand out `ordered` GPUs k per rank; with share=true, round-robin when there are too few."""
    k, n = p["gpus_per_rank"], len(ordered)
    if lws * k <= n:
        return NodePlan(name, tuple(tuple(ordered[r * k:(r + 1) * k]) for r in range(lws)), scores or {})
    if not p["share"]:
        have = f"gpu_map.gpus={p['gpus']} lists {n}" if p["gpus"] is not None else f"this node has {n} usable"
        raise UserError(f"gpu_map.strategy={name}: {lws} local ranks x {k} GPU(s) per rank need {lws * k} "
                        f"GPUs but {have}; set gpu_map.share=true or start fewer ranks")
    if k > 1:
        raise UserError(f"gpu_map.share=true with gpu_map.gpus_per_rank={k}: ranks can share only with one GPU "
                        "per rank; set gpu_map.gpus_per_rank=1 or start fewer ranks")
    return NodePlan(name, tuple((ordered[r % n],) for r in range(lws)), scores or {})


def _scores(gpus, given) -> dict[int, float]:
    """Default scores, overridden by gpu_map.scores keys: a UUID beats an index beats a name."""
    result = {g.index: g.score if g.score is not None else float(g.sm_count * g.clock_mhz) for g in gpus}
    rank: dict[int, int] = {}
    for key, value in given.items():
        text = str(key).strip()
        if isinstance(key, int) or text.isdigit():
            level, hits = 2, [g for g in gpus if g.index == int(text)]
        else:
            level, hits = 3, [g for g in gpus if g.uuid == text]
            if not hits:
                level, hits = 1, [g for g in gpus if g.name == text]
        if not hits:
            raise UserError(f"gpu_map.scores.{key}: matches no GPU on this node; keys are an index "
                            f"({_span([g.index for g in gpus])}), "
                            f"an exact name ({', '.join(sorted({g.name for g in gpus}))}) "
                            "or a UUID (nvidia-smi -L)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"gpu_map.scores.{key}={value!r}: expected a number (higher is better)")
        for g in hits:
            if rank.get(g.index, 0) < level:
                result[g.index], rank[g.index] = float(value), level
    return result


def _settings(params: Mapping) -> dict:
    """Defaults for missing or null keys, and the range checks a config schema may not have made."""
    p = {**_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    for key, low, high in (("gpus_per_rank", 1, None), ("min_free_mb", 0, None), ("max_util", 0, 100)):
        v = p[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
            raise UserError(f"gpu_map.{key}={v!r}: expected an integer " + (f"{low}..{high}" if high else f">= {low}"))
    if not isinstance(p["share"], bool):
        raise UserError(f"gpu_map.share={p['share']!r}: expected true or false")
    if p["gpus"] is not None:
        p["gpus"] = [p["gpus"]] if isinstance(p["gpus"], int) else list(p["gpus"])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in p["gpus"]):
            raise UserError(f"gpu_map.gpus={p['gpus']!r}: expected a list of GPU indices like [0, 1]")
    if not isinstance(p["scores"], Mapping):
        raise UserError(f"gpu_map.scores={p['scores']!r}: expected a mapping like {{0: 2.0, A100: 1.5}}")
    return p


def _span(indices) -> str:
    """'0..3' for a contiguous run, else '2, 5'."""
    indices = list(indices)
    if len(indices) > 2 and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}..{indices[-1]}"
    return ", ".join(map(str, indices)) or "none"
