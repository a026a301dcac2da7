"""expgpu.gpus on simulated nodes: which NVML index each local rank gets, and the errors users see."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from conftest import REPO, pythonpath
from expgpu.errors import UserError
from expgpu.gpus import STRATEGIES, NodePlan, apply, inventory, plan, set_device_ordinal
from expgpu.gpus.mask import gpu_env

SRC = str(REPO / "src")

HOMOGENEOUS = [{"name": "A100", "memory_mb": 81920} for _ in range(4)]
# Interleaved in PCI order, as in a workstation that got two newer cards later.
MIXED = [{"name": "A100", "memory_mb": 40960}, {"name": "V100", "memory_mb": 32768},
         {"name": "A100", "memory_mb": 40960}, {"name": "V100", "memory_mb": 32768}]
EIGHT = [{"name": "T4", "memory_mb": 15360}, {"name": "V100", "memory_mb": 32768},
         {"name": "H100", "memory_mb": 81920}, {"name": "A100", "memory_mb": 40960},
         {"name": "T4", "memory_mb": 15360}, {"name": "H100", "memory_mb": 81920},
         {"name": "V100", "memory_mb": 32768}, {"name": "A100", "memory_mb": 81920}]
BUSY = [{"name": "A100", "memory_mb": 81920, "free_mb": 2000, "util": 95},
        {"name": "A100", "memory_mb": 81920, "free_mb": 70000, "util": 10},
        {"name": "A100", "memory_mb": 81920, "free_mb": 80000, "util": 50},
        {"name": "A100", "memory_mb": 81920, "free_mb": 80000, "util": 5}]


def node(spec, mask=None):
    return inventory(simulate=spec, env={} if mask is None else {"CUDA_VISIBLE_DEVICES": mask})


def ranks(gpus, n, /, **params):
    """NVML indices per local rank: what a user would read in the dry-run table."""
    return [[g.index for g in a] for a in plan(gpus, n, params).assignments]


def fails(match, fn, *args, **kwargs):
    with pytest.raises(UserError, match=match) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


# --- strategies -------------------------------------------------------------------------------------

def test_sequential_gives_rank_r_the_rth_gpu():
    assert ranks(node(HOMOGENEOUS), 4, strategy="sequential") == [[0], [1], [2], [3]]
    assert ranks(node(MIXED), 2) == [[0], [1]]   # sequential is the default


def test_ranked_puts_faster_cards_first_on_mixed_nodes():
    assert ranks(node(MIXED), 2, strategy="ranked") == [[0], [2]]
    assert ranks(node(MIXED), 4, strategy="ranked") == [[0], [2], [1], [3]]
    # H100 > A100 (80 GB before 40 GB: same score, more memory) > V100 > T4, lower index on full ties
    assert ranks(node(EIGHT), 8, strategy="ranked") == [[2], [5], [7], [3], [1], [6], [0], [4]]


def test_ranked_uses_only_the_top_n_when_gpus_outnumber_ranks():
    assert ranks(node(EIGHT), 3, strategy="ranked") == [[2], [5], [7]]
    result = plan(node(EIGHT), 1, {"strategy": "ranked"})
    assert result.scores[2] == 132 * 1980 and len(result.scores) == 8   # every GPU in the dry-run table


def test_ranked_config_scores_by_index_name_and_uuid():
    gpus = node(MIXED)
    assert ranks(gpus, 2, strategy="ranked", scores={3: 1e9}) == [[3], [0]]
    assert ranks(gpus, 2, strategy="ranked", scores={"1": 1e9}) == [[1], [0]]   # YAML string key
    assert ranks(gpus, 2, strategy="ranked", scores={"V100": 1e9}) == [[1], [3]]
    assert ranks(gpus, 2, strategy="ranked", scores={"V100": 1e9, "GPU-sim-3": 2e9}) == [[3], [1]]
    # a UUID beats an index beats a name, whatever the order of the keys
    assert ranks(gpus, 1, strategy="ranked", scores={"GPU-sim-1": 1.0, 1: 9e9, "V100": 5e9}) == [[3]]


def test_ranked_simulated_score_replaces_the_spec_score():
    gpus = node([{"name": "H100", "memory_mb": 81920, "score": 1.0}, {"name": "T4", "memory_mb": 15360, "score": 2.5}])
    assert ranks(gpus, 2, strategy="ranked") == [[1], [0]]


def test_ranked_unknown_score_key_is_named():
    fails(r"gpu_map\.scores\.RTX 9090: matches no GPU.*A100, V100", plan, node(MIXED), 1,
          {"strategy": "ranked", "scores": {"RTX 9090": 2.0}})
    fails(r"gpu_map\.scores\.7: matches no GPU.*0\.\.3", plan, node(MIXED), 1,
          {"strategy": "ranked", "scores": {7: 2.0}})
    fails(r"gpu_map\.scores\.0='fast': expected a number", plan, node(MIXED), 1,
          {"strategy": "ranked", "scores": {0: "fast"}})


def test_free_memory_prefers_free_then_idle_and_skips_busy_gpus():
    gpus = node(BUSY)
    assert ranks(gpus, 2, strategy="free_memory") == [[3], [2]]   # equal free memory: the idle one first
    assert ranks(gpus, 3, strategy="free_memory", min_free_mb=50000) == [[3], [2], [1]]
    assert ranks(gpus, 2, strategy="free_memory", max_util=20) == [[3], [1]]
    assert ranks(gpus, 4, strategy="free_memory", min_free_mb=50000, share=True) == [[3], [2], [1], [3]]


def test_free_memory_error_names_the_filters_and_what_remains():
    msg = fails(r"gpu_map\.min_free_mb=50000 / gpu_map\.max_util=100 leave 3 of 4 GPUs", plan,
                node(BUSY), 4, {"strategy": "free_memory", "min_free_mb": 50000})
    assert "4 local ranks" in msg
    fails(r"gpu_map\.max_util=1 leave 0 of 4", plan, node(BUSY), 1, {"strategy": "free_memory", "max_util": 1})


def test_custom_gives_each_rank_its_listed_gpu():
    assert ranks(node(MIXED), 2, strategy="custom", gpus=[3, 1]) == [[3], [1]]
    assert ranks(node(MIXED), 2, strategy="custom", gpus=[2, 0, 1]) == [[2], [0]]   # extra entries unused


@pytest.mark.parametrize("gpus, match", [
    ([0, 7], r"gpu_map\.gpus=\[0, 7\]: asks for GPU 7 but this node has 0\.\.3 only"),
    ([0, 0], r"gpu_map\.gpus=\[0, 0\]: GPU 0 listed twice; give each local rank a different GPU index \(0\.\.3\)"),
    ([1], r"gpu_map\.gpus=\[1\]: 1 indices for 2 local ranks x 1 GPU\(s\) per rank; list 2"),
    (None, r"gpu_map\.gpus is not set: strategy=custom needs 2 GPU indices.*gpu_map\.gpus=\[0,1\]"),
    (["a"], r"gpu_map\.gpus=\['a'\]: expected a list of GPU indices"),
])
def test_custom_errors_name_gpu_map_gpus(gpus, match):
    fails(match, plan, node(HOMOGENEOUS), 2, {"strategy": "custom", "gpus": gpus})


def test_gpu_map_gpus_narrows_every_strategy_to_the_listed_gpus():
    """gpu_map.gpus=[2,3] means "use GPUs 2 and 3", whatever the strategy: sequential deals them in the listed
    order, ranked and free_memory rank only them (it was read by custom alone: the others silently used GPU 0)."""
    assert ranks(node(MIXED), 2, strategy="sequential", gpus=[3, 1]) == [[3], [1]]
    assert ranks(node(MIXED), 1, gpus=[2]) == [[2]]   # sequential, the default
    assert ranks(node(EIGHT), 2, strategy="ranked", gpus=[0, 1, 3, 4]) == [[3], [1]]   # the A100, then the V100
    assert ranks(node(BUSY), 1, strategy="free_memory", gpus=[0, 1]) == [[1]]
    assert ranks(node(HOMOGENEOUS), 2, strategy="sequential", gpus_per_rank=2, gpus=[3, 2, 1, 0]) == [[3, 2], [1, 0]]
    assert ranks(node(HOMOGENEOUS), 2, strategy="sequential", gpus=[2], share=True) == [[2], [2]]
    # gpu_map.scores may still name a GPU of the node that the list leaves out
    assert ranks(node(MIXED), 1, strategy="ranked", gpus=[1, 3], scores={0: 9e9, 3: 9e8}) == [[3]]
    # indices are NVML's, also where an inherited mask narrowed the node
    assert ranks(node(HOMOGENEOUS, mask="2,3"), 1, gpus=[3]) == [[3]]


@pytest.mark.parametrize("strategy", ["sequential", "ranked", "free_memory"])
@pytest.mark.parametrize("spec, params, match", [
    (HOMOGENEOUS, {"gpus": [0, 7]}, r"gpu_map\.gpus=\[0, 7\]: asks for GPU 7 but this node has 0\.\.3 only"),
    (HOMOGENEOUS, {"gpus": [1, 1]}, r"gpu_map\.gpus=\[1, 1\]: GPU 1 listed twice"),
    (HOMOGENEOUS, {"gpus": [1]}, r"need 2 GPUs but gpu_map\.gpus=\[1\] lists 1; set gpu_map\.share=true"),
    ([], {"gpus": [0]}, r"gpu_map\.gpus=\[0\]: asks for GPU 0 but this node has no GPUs"),
])
def test_gpu_map_gpus_errors_for_every_strategy(strategy, spec, params, match):
    fails(match, plan, node(spec), 2, {"strategy": strategy, **params})


@pytest.mark.parametrize("strategy, params, match", [
    ("sequential", {"scores": {0: 2.0}}, r"gpu_map\.scores=\{0: 2\.0\} is read by gpu_map=ranked only, and this "
                                         r"run's strategy is sequential: choose gpu_map=ranked or drop the key"),
    ("ranked", {"min_free_mb": 20000}, r"gpu_map\.min_free_mb=20000 is read by gpu_map=free_memory only"),
    ("custom", {"gpus": [0, 1], "max_util": 50}, r"gpu_map\.max_util=50 is read by gpu_map=free_memory only"),
])
def test_a_key_the_strategy_does_not_read_is_an_error_not_ignored(strategy, params, match):
    fails(match, plan, node(HOMOGENEOUS), 2, {"strategy": strategy, **params})
    # at their defaults (as every gpu_map file sets them) they are no error
    assert ranks(node(HOMOGENEOUS), 1, strategy=strategy, gpus=[0], scores={}, min_free_mb=0, max_util=100) == [[0]]


def test_custom_duplicate_is_allowed_when_sharing_is_asked_for():
    assert ranks(node(HOMOGENEOUS), 2, strategy="custom", gpus=[1, 1], share=True) == [[1], [1]]


def test_more_ranks_than_gpus_errors_unless_share():
    msg = fails(r"6 local ranks x 1 GPU\(s\) per rank need 6 GPUs but this node has 4", plan, node(HOMOGENEOUS), 6, {})
    assert "gpu_map.share=true" in msg and "fewer ranks" in msg
    assert ranks(node(HOMOGENEOUS), 6, share=True) == [[0], [1], [2], [3], [0], [1]]
    assert ranks(node(MIXED), 3, strategy="ranked", share=True) == [[0], [2], [1]]


def test_gpus_per_rank_gives_consecutive_gpus():
    assert ranks(node(HOMOGENEOUS), 2, gpus_per_rank=2) == [[0, 1], [2, 3]]
    assert ranks(node(EIGHT), 2, strategy="ranked", gpus_per_rank=2) == [[2, 5], [7, 3]]
    assert ranks(node(HOMOGENEOUS), 2, strategy="custom", gpus=[3, 2, 1, 0], gpus_per_rank=2) == [[3, 2], [1, 0]]
    fails(r"need 6 GPUs but this node has 4", plan, node(HOMOGENEOUS), 3, {"gpus_per_rank": 2})
    fails(r"gpu_map\.share=true with gpu_map\.gpus_per_rank=2", plan, node(HOMOGENEOUS), 3,
          {"gpus_per_rank": 2, "share": True})
    fails(r"gpu_map\.gpus_per_rank=0: expected an integer >= 1", plan, node(HOMOGENEOUS), 1, {"gpus_per_rank": 0})


def test_no_gpus_means_cpu_for_every_strategy_but_an_explicit_gpu_list():
    own = {"ranked": {"scores": {"A100": 2.0}}, "free_memory": {"min_free_mb": 10**6}}
    for name in STRATEGIES:
        result = plan([], 3, {"strategy": name, **own.get(name, {})})
        assert result.assignments == ((), (), ()) and result.gpus_of(2) == ()
    fails(r"gpu_map\.gpus=\[0\]: asks for GPU 0 but this node has no GPUs", plan, [], 1,
          {"strategy": "custom", "gpus": [0]})


def test_unknown_strategy_lists_the_allowed_ones():
    fails(r"gpu_map\.strategy='fastest': unknown; allowed: sequential, custom, ranked, free_memory",
          plan, node(MIXED), 1, {"strategy": "fastest"})


def test_plan_is_json_able():
    result = plan(node(MIXED), 2, {"strategy": "ranked", "gpus": None, "scores": {}, "score": "spec"})
    data = json.loads(json.dumps(result.to_dict()))
    assert data["strategy"] == "ranked" and data["assignments"] == [[0], [2]]
    assert [g["index"] for g in data["gpus"]] == [0, 1, 2, 3] and data["scores"]["1"] == 80 * 1530
    assert NodePlan.from_dict(data) == result   # how a parent hands its plan to the local ranks
    masked = plan(node(EIGHT, "7,2,5"), 4, {"share": True})
    assert NodePlan.from_dict(json.loads(json.dumps(masked.to_dict()))) == masked
    fails(r"local rank 2 is not in this node's plan of 2 local ranks", result.gpus_of, 2)


# --- inventory --------------------------------------------------------------------------------------

def test_simulated_inventory_defaults_from_the_known_gpu_table():
    a100, t4, odd = node([{"name": "NVIDIA A100-SXM4-80GB", "memory_mb": 81920, "free_mb": 100, "util": 7},
                          {"name": "Tesla T4", "memory_mb": 15360}, {"name": "Mystery", "memory_mb": 1}])
    assert (a100.sm_count, a100.clock_mhz, a100.memory_free_mb, a100.utilization) == (108, 1410, 100, 7)
    assert (t4.index, t4.uuid, t4.memory_free_mb, t4.sm_count) == (1, "GPU-sim-1", 15360, 40)
    assert (odd.sm_count, odd.clock_mhz, odd.score) == (0, 0, None)


@pytest.mark.parametrize("bad, match", [
    ({"name": "A100"}, r"inventory\.simulate\[1\]\.memory_mb: missing"),
    ({"name": "A100", "memory_mb": 10, "memroy": 1}, r"inventory\.simulate\[1\]\.memroy: unknown key; allowed: name"),
    ({"name": "A100", "memory_mb": -5}, r"inventory\.simulate\[1\]\.memory_mb=-5: not allowed"),
    ({"name": "A100", "memory_mb": "lots"}, r"inventory\.simulate\[1\]\.memory_mb='lots'"),
    ({"name": "A100", "memory_mb": 100, "free_mb": 200},
     r"inventory\.simulate\[1\]\.free_mb=200: more than memory_mb=100"),
    ({"name": "A100", "memory_mb": 100, "util": 101},
     r"inventory\.simulate\[1\]\.util=101: not allowed; expected 0\.\.100"),
    ({"name": "A100", "memory_mb": 100, "score": -1}, r"inventory\.simulate\[1\]\.score=-1"),
    ({"name": "A100", "memory_mb": 100, "uuid": "GPU-sim-0"},
     r"inventory\.simulate\[1\]\.uuid='GPU-sim-0': already used"),
    ({"name": "", "memory_mb": 100}, r"inventory\.simulate\[1\]\.name=''"),
    ("A100", r"inventory\.simulate\[1\]='A100': expected a mapping"),
])
def test_simulate_errors_name_the_entry_and_key(bad, match):
    fails(match, node, [{"name": "A100", "memory_mb": 100}, bad])


def test_no_nvml_means_no_gpus(monkeypatch):
    import pynvml

    def refuse():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)   # what this GPU-less machine does
    monkeypatch.setattr(pynvml, "nvmlInit", refuse)
    assert inventory(env={}) == []
    assert inventory(env={"CUDA_VISIBLE_DEVICES": "0,1"}) == []   # a stale mask on a CPU node is not an error
    monkeypatch.setitem(sys.modules, "pynvml", None)               # nvidia-ml-py not installed
    assert inventory(env={}) == []
    assert plan(inventory(env={}), 2, {"strategy": "ranked"}).assignments == ((), ())


def test_nvml_inventory_reads_every_field_and_survives_refused_ones(monkeypatch, caplog):
    import pynvml

    names = ["NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 5090"]   # the second is not in the table
    shut = []

    def refused(*_):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def util(h):
        return SimpleNamespace(gpu=42) if h == 0 else refused()
    fake = {"nvmlInit": lambda: None, "nvmlShutdown": lambda: shut.append(1), "nvmlDeviceGetCount": lambda: 2,
            "nvmlDeviceGetHandleByIndex": lambda i: i, "nvmlDeviceGetName": lambda h: names[h],
            "nvmlDeviceGetUUID": lambda h: f"GPU-{h}abc", "nvmlDeviceGetUtilizationRates": util,
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=f"00000000:{h + 7:02X}:00.0".encode()),
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=80 * 2**30, free=60 * 2**30),
            "nvmlDeviceGetArchitecture":
                lambda h: [pynvml.NVML_DEVICE_ARCH_AMPERE, pynvml.NVML_DEVICE_ARCH_BLACKWELL][h],
            "nvmlDeviceGetNumGpuCores": lambda h: [6912, 21760][h],
            "nvmlDeviceGetMigMode": lambda h: [1, 1] if h == 1 else refused(),
            "nvmlDeviceGetMaxClockInfo": lambda h, kind: 1410 if kind == pynvml.NVML_CLOCK_SM else refused()}
    for name, fn in fake.items():
        monkeypatch.setattr(pynvml, name, fn)
    a100, rtx = inventory(env={})
    assert (a100.index, a100.name, a100.uuid, a100.pci_bus_id) == (0, names[0], "GPU-0abc", "00000000:07:00.0")
    assert (a100.memory_total_mb, a100.memory_free_mb, a100.utilization, a100.sm_count, a100.clock_mhz) == \
        (81920, 61440, 42, 108, 1410)
    assert (rtx.utilization, rtx.sm_count) == (0, 170)   # refused -> 0; SMs from cores / 128 per SM
    assert shut == [1]   # nvmlShutdown always
    assert "GPU 1 (NVIDIA GeForce RTX 5090) is in MIG mode" in caplog.text
    assert [g.index for g in inventory(env={"CUDA_VISIBLE_DEVICES": "GPU-1a"})] == [1]


# --- CUDA_VISIBLE_DEVICES -----------------------------------------------------------------------------

def test_mask_narrows_by_index_and_uuid_in_mask_order():
    assert [g.index for g in node(HOMOGENEOUS, "3,1")] == [3, 1]
    assert [g.index for g in node(HOMOGENEOUS, " 2 , 0 ")] == [2, 0]
    assert [g.index for g in node(HOMOGENEOUS, "GPU-sim-2,GPU-sim-0")] == [2, 0]
    assert [g.index for g in node(HOMOGENEOUS, "1,GPU-sim-3")] == [1, 3]
    uuids = [dict(g, uuid=u) for g, u in zip(MIXED, ["GPU-8f3a-11", "GPU-8f3a-22", "GPU-c0de-33", "GPU-beef-44"])]
    assert [g.index for g in node(uuids, "GPU-c0de,beef")] == [2, 3]   # unique prefixes, "GPU-" optional
    fails(r"CUDA_VISIBLE_DEVICES='GPU-8f3a': entry 'GPU-8f3a' matches 2 GPUs", node, uuids, "GPU-8f3a")


def test_mask_then_plan_gives_rank_r_the_rth_visible_gpu():
    gpus = node(HOMOGENEOUS, "3,1")
    assert ranks(gpus, 2) == [[3], [1]]
    fails(r"gpu_map\.gpus=\[0, 1\]: asks for GPU 0 but this node has 1, 3 only", plan, gpus, 2,
          {"strategy": "custom", "gpus": [0, 1]})
    fails(r"need 3 GPUs but this node has 2", plan, gpus, 3, {})


def test_empty_mask_means_no_gpus():
    for value in ("", "-1", "NoDevFiles"):
        assert node(HOMOGENEOUS, value) == []
        assert plan(node(HOMOGENEOUS, value), 2, {"strategy": "ranked"}).assignments == ((), ())


@pytest.mark.parametrize("mask, match", [
    ("0,7", r"CUDA_VISIBLE_DEVICES='0,7': entry '7' matches no GPU on this node; allowed: indices 0, 1, 2, 3"),
    ("GPU-nope", r"CUDA_VISIBLE_DEVICES='GPU-nope': entry 'GPU-nope' matches no GPU"),
    ("1,1", r"CUDA_VISIBLE_DEVICES='1,1': entry '1' names GPU 1 a second time"),
    ("MIG-4f2a-11", r"CUDA_VISIBLE_DEVICES='MIG-4f2a-11': MIG slices are not supported"),
])
def test_bad_mask_is_named(mask, match):
    fails(match, node, HOMOGENEOUS, mask)


def test_mask_under_slurm_cgroups_maps_positionally():
    # NVML sees only the 2 allocated GPUs (0, 1); SLURM's mask keeps the node-wide numbers.
    two = MIXED[:2]
    assert [g.index for g in node(two, "2,3")] == [0, 1]
    assert [g.index for g in node(two, "7,5")] == [1, 0]   # the smaller number is the lower PCI bus id
    fails(r"CUDA_VISIBLE_DEVICES='2,3,4'", node, two, "2,3,4")   # counts differ: no guessing
    fails(r"CUDA_VISIBLE_DEVICES='1,3'", node, two, "1,3")       # 1 is in range: a real index


# --- apply ----------------------------------------------------------------------------------------------

def test_gpu_env_uses_nvml_indices_in_pci_order():
    gpus = node(HOMOGENEOUS)
    assert gpu_env((gpus[3],)) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"}
    assert gpu_env((gpus[2], gpus[0]))["CUDA_VISIBLE_DEVICES"] == "2,0"
    # A CUDA_DEVICE_ORDER the user chose is kept (not in the env): the GPUs are named by UUID
    assert gpu_env((gpus[1],), "FASTEST_FIRST") == {"CUDA_VISIBLE_DEVICES": "GPU-sim-1"}
    assert gpu_env(()) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ""}   # no GPU at all


def test_set_device_ordinal_is_the_position_in_the_inherited_mask():
    gpus = node(HOMOGENEOUS, "3,1")
    assert set_device_ordinal(gpus[0], gpus) == 0 and set_device_ordinal(gpus[1], gpus) == 1
    everything = node(HOMOGENEOUS)
    assert set_device_ordinal(everything[2], everything) == 2
    fails(r"GPU 2 is not among the GPUs this process sees \(3, 1\)", set_device_ordinal, everything[2], gpus)


def test_apply_visible_devices_narrows_the_inherited_mask(caplog):
    gpus = node(HOMOGENEOUS, "3,1,2")
    env = {"CUDA_VISIBLE_DEVICES": "3,1,2"}
    with caplog.at_level(logging.INFO, logger="expgpu.gpus.apply"):
        device = apply(plan(gpus, 3, {}), 1, "visible_devices", env)
    assert str(device) == "cuda:0"
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert "narrowing inherited CUDA_VISIBLE_DEVICES=3,1,2 to 1" in caplog.text


def test_apply_keeps_a_user_device_order_and_switches_to_uuids(caplog):
    env = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    with caplog.at_level(logging.WARNING):
        apply(plan(node(HOMOGENEOUS), 2, {"gpus_per_rank": 2}), 1, "visible_devices", env)
    assert env == {"CUDA_DEVICE_ORDER": "FASTEST_FIRST", "CUDA_VISIBLE_DEVICES": "GPU-sim-2,GPU-sim-3"}
    assert "CUDA_DEVICE_ORDER=FASTEST_FIRST kept" in caplog.text


def test_apply_detects_a_mask_set_after_cuda_started(monkeypatch):
    import torch

    # torch.cuda.is_available() ran cuInit with all 4 GPUs visible; is_initialized() still says False.
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 4, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")   # restored after the test, as is the order
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    fails(r"CUDA started before expgpu set CUDA_VISIBLE_DEVICES \(it sees 4 GPUs, not 1\)", apply,
          plan(node(HOMOGENEOUS), 4, {}), 2, "visible_devices", os.environ)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1, raising=False)
    assert str(apply(plan(node(HOMOGENEOUS), 4, {}), 3, "visible_devices", os.environ)) == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_apply_cpu_rank_sets_nothing():
    env = {}
    assert str(apply(plan([], 2, {}), 1, "visible_devices", env)) == "cpu" and env == {}


def test_apply_refuses_after_cuda_started_and_unknown_isolation(monkeypatch):
    gpus_apply = sys.modules["expgpu.gpus.apply"]   # the package's `apply` attribute is the function

    the_plan = plan(node(HOMOGENEOUS), 1, {})
    fails(r"launch\.isolation='env': unknown; allowed: visible_devices, set_device", apply, the_plan, 0, "env", {})
    monkeypatch.setattr(gpus_apply, "cuda_initialized", lambda: True)
    env = {}
    fails(r"CUDA was initialized before expgpu.*launch\.isolation=set_device", apply, the_plan, 0,
          "visible_devices", env)
    assert "CUDA_VISIBLE_DEVICES" not in env
    env = {"CUDA_VISIBLE_DEVICES": "0"}   # already isolated (a second call, a per-task mask): nothing to change
    assert str(apply(the_plan, 0, "visible_devices", env)) == "cuda:0"


def test_apply_set_device_without_cuda_is_a_clear_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # never start CUDA in the test runner
    fails(r"launch\.isolation=set_device: local rank 0 was planned GPU 0 but this process sees no CUDA device",
          apply, plan(node(HOMOGENEOUS), 1, {}), 0, "set_device", {})


def test_apply_set_device_picks_the_ordinal_and_trusts_uuids(monkeypatch):
    import torch

    gpus = node(HOMOGENEOUS, "3,1,2")
    cuda_uuids = ["sim-3", "sim-1", "sim-2"]   # what CUDA reports (no "GPU-" prefix) in mask order
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(cuda_uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=cuda_uuids[i]))
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    env = {"CUDA_VISIBLE_DEVICES": "3,1,2"}
    assert str(apply(plan(gpus, 3, {}), 1, "set_device", env)) == "cuda:1" and chosen == [1]
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1,2"   # set_device keeps the inherited mask
    cuda_uuids.reverse()   # CUDA started in another order (FASTEST_FIRST): the UUID decides
    assert str(apply(plan(gpus, 3, {}), 0, "set_device", env)) == "cuda:2" and chosen == [1, 2]


def test_importing_expgpu_gpus_does_not_import_torch():
    code = "import expgpu.gpus, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": pythonpath(SRC)})


# --- on a real GPU node -------------------------------------------------------------------------------

def _on_gpu_node(code: str) -> str:
    """Run `code` in a fresh process (this one must not start CUDA); skip without a CUDA build and a GPU.
    The check uses NVML only: torch.cuda.is_available() would run cuInit before the mask is set."""
    prelude = ("import sys, torch\nfrom expgpu.gpus import inventory\n"
               "if torch.version.cuda is None or not inventory(): sys.exit(77)\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    run = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": pythonpath(SRC), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, timeout=240)
    if run.returncode == 77:
        pytest.skip("no CUDA device")
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.gpu
def test_nvml_inventory_matches_torch_cuda():
    _on_gpu_node("""
        gpus = inventory()
        assert len(gpus) == torch.cuda.device_count(), (gpus, torch.cuda.device_count())
        for i, g in enumerate(gpus):
            props = torch.cuda.get_device_properties(i)
            assert g.name == props.name, (g.name, props.name)
            assert g.uuid.lower() == "gpu-" + str(props.uuid).lower(), (g.uuid, props.uuid)
            assert g.sm_count in (0, props.multi_processor_count), (g.name, g.sm_count, props.multi_processor_count)
            assert g.memory_total_mb > 0 and g.clock_mhz > 0, g
    """)


@pytest.mark.gpu
@pytest.mark.parametrize("isolation", ["visible_devices", "set_device"])
def test_the_planned_gpu_lands_in_the_process(isolation):
    _on_gpu_node(f"""
        from expgpu.gpus import apply, plan
        gpus = inventory()
        last = len(gpus) - 1
        device = apply(plan(gpus, len(gpus), {{}}), last, "{isolation}")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        assert "gpu-" + str(props.uuid).lower() == gpus[last].uuid.lower(), (props, gpus[last])
        if "{isolation}" == "visible_devices":
            assert torch.cuda.device_count() == 1 and str(device) == "cuda:0"
        else:
            assert str(device) == f"cuda:{{last}}"
    """)
