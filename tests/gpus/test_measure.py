"""gpu_map.score=measured: the matmul benchmark (in a child process), its cache, the dry-run table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import clean_env, expgpu
from expgpu.errors import UserError
from expgpu.gpus import Gpu, measure


def _gpu(index, uuid, util=0):
    return Gpu(index, "NVIDIA A100-SXM4-40GB", uuid, f"00000000:0{index}:00.0", 40960, 40960, util, 108, 1410)


class Bench:
    """A stand-in benchmark that counts its calls: the cache, not the matmul, is under test here."""

    def __init__(self):
        self.calls = []

    def __call__(self, gpu, dtype):
        self.calls.append((gpu.index, dtype))
        return 10.0 + gpu.index


def test_cache_measures_each_gpu_once_per_driver_torch_and_dtype(tmp_path):
    gpus, bench = [_gpu(0, "GPU-aaa"), _gpu(1, "GPU-bbb")], Bench()
    assert measure.Cache(tmp_path, "550.54", "2.5.1+cu124", "float32").scores(gpus, bench) == {0: 10.0, 1: 11.0}
    assert sorted(bench.calls) == [(0, "float32"), (1, "float32")]
    # the same key again: read from the cache, nothing measured
    assert measure.Cache(tmp_path, "550.54", "2.5.1+cu124", "float32").scores(gpus, bench) == {0: 10.0, 1: 11.0}
    assert len(bench.calls) == 2
    # a new driver, a new torch build, another dtype: measured again
    for driver, torch_v, dtype in (("560.28", "2.5.1+cu124", "float32"), ("550.54", "2.5.1+cu121", "float32"),
                                   ("550.54", "2.5.1+cu124", "bfloat16")):
        measure.Cache(tmp_path, driver, torch_v, dtype).scores(gpus[:1], bench)
    assert len(bench.calls) == 5
    saved = json.loads((tmp_path / measure.CACHE_FILE).read_text())
    assert saved[measure.cache_key("GPU-aaa", "550.54", "2.5.1+cu124", "float32")]["tflops"] == 10.0
    assert len(saved) == 5


def test_a_busy_gpu_is_measured_but_not_cached_and_a_corrupt_cache_is_rewritten(tmp_path):
    (tmp_path / measure.CACHE_FILE).write_text("{not json")
    bench = Bench()
    cache = measure.Cache(tmp_path, "d", "t", "float32")
    assert cache.scores([_gpu(0, "GPU-a", util=90), _gpu(1, "GPU-b")], bench) == {0: 10.0, 1: 11.0}
    saved = json.loads((tmp_path / measure.CACHE_FILE).read_text())
    assert list(saved) == [measure.cache_key("GPU-b", "d", "t", "float32")]


@pytest.mark.slow
def test_the_benchmark_child_reports_tflops_on_the_cpu():
    tflops = measure.measure_in_child(None, "float32", clean_env(), timeout_s=120, device="cpu")
    assert 0 < tflops < 100


@pytest.mark.slow
def test_a_benchmark_that_cannot_run_names_the_gpu():
    # a CUDA benchmark where CUDA has no such device (always true on a CPU machine; on a GPU
    # machine the UUID names no GPU): one line naming GPU 7, no traceback
    gpu = _gpu(7, "GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(UserError, match=r"benchmark on GPU 7 \(NVIDIA A100-SXM4-40GB\) failed"):
        measure.measure_in_child(gpu, "float32", clean_env(), timeout_s=120)


def test_simulated_gpus_take_their_score_or_a_spec_stand_in_and_never_measure(tmp_path):
    sim = ("inventory.simulate=[{name:H100,memory_mb:81559},{name:V100,memory_mb:16384},"
           "{name:A100,memory_mb:40960,score:99.5}]")
    run = expgpu(["dry_run=true", "gpu_map=ranked", "gpu_map.score=measured", "launch.nproc_per_node=3", sim],
                 tmp_path / "run", env=clean_env(EXPGPU_CACHE_DIR=str(tmp_path / "cache")))
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()[2:5]]
    assert [r[4] for r in rows] == ["A100", "H100", "V100"]        # the given score ranks first
    assert [r[-1] for r in rows] == ["99.5", "66.91", "31.33"]     # H100: 132 SMs x 1980 MHz x 256
    assert not (tmp_path / "cache").exists()


def test_measure_dtype_is_checked_by_the_schema(tmp_path):
    run = expgpu(["dry_run=true", "gpu_map.measure_dtype=int8"], tmp_path / "run")
    assert run.returncode == 2 and "gpu_map.measure_dtype" in run.stderr and "Traceback" not in run.stderr


SCORE_IN_A_FRESH_PROCESS = """
import json, sys, time
from expgpu.gpus import inventory, measure
t0 = time.monotonic()
gpus = measure.scored(inventory(), sys.argv[1], simulated=False)
print(json.dumps({"scores": [g.score for g in gpus], "uuids": [g.uuid for g in gpus],
                  "seconds": time.monotonic() - t0, "torch_imported": "torch" in sys.modules}))
"""


def _score(dtype, env):
    proc = subprocess.run([sys.executable, "-c", SCORE_IN_A_FRESH_PROCESS, dtype], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_real_gpus_are_measured_in_children_and_cached(tmp_path):
    env = clean_env(EXPGPU_CACHE_DIR=str(tmp_path))
    first = _score("float32", env)
    assert all(s > 0.5 for s in first["scores"]), first   # any CUDA GPU beats 0.5 TFLOP/s in fp32
    assert not first["torch_imported"], "the planning process imported torch (and could start CUDA)"
    saved = json.loads((tmp_path / measure.CACHE_FILE).read_text())
    assert {v["uuid"] for v in saved.values()} == set(first["uuids"])
    again = _score("float32", env)
    assert again["scores"] == first["scores"] and again["seconds"] < 2.0   # from the cache
    half = _score("bfloat16", env)
    assert all(s > 0 for s in half["scores"])
    assert len(json.loads((tmp_path / measure.CACHE_FILE).read_text())) == 2 * len(first["uuids"])


@pytest.mark.gpu
def test_dry_run_shows_measured_scores_of_real_gpus(tmp_path):
    run = expgpu(["dry_run=true", "gpu_map=ranked", "gpu_map.score=measured"], tmp_path / "run",
                 env=clean_env(EXPGPU_CACHE_DIR=str(tmp_path / "cache")))
    assert run.returncode == 0, run.stderr
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["ranks"][0]["scores"][0] > 0.5
    assert (tmp_path / "cache" / measure.CACHE_FILE).exists()
