#!/usr/bin/env bash
# The checks that need a GPU, as one script for a GPU node that has PyTorch (with CUDA) but not
# expgpu's other dependencies (a lent machine with no network: they travel as wheels in .whl/).
#
#     bash bench/gpu_session.sh [OUT_DIR]
#     PARTS="main tests fast" bash bench/gpu_session.sh  # some of: main tests fast bench
#
# All four parts take ~11 min on an H100 node (bench ~6, fast 3 or more): more than one 10-minute call
# of a lent machine, so run them as two calls, "main tests fast" and then "bench".
#
# Each part has its own time limit and its own log under OUT_DIR (default /tmp/expgpu-gpu); the
# summary at the end says which passed. Parts: the machine; the main job on the GPU (fp32, bf16,
# and launch.wrap=fsdp: on one rank that is FSDP2 without a process group, so nccl itself needs a
# 2-GPU node); the tests marked gpu; the fast tier with a GPU visible; bench_run_api on the GPU (the
# Run API's cost against a plain loop on the same GPU, with a tiny model and with one whose GPU work
# decides the step); launch to first step on the GPU against a plain one-GPU script
# (bench_ddp_overhead --gpu --nproc 1).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/expgpu-gpu}}
mkdir -p "$OUT"
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The lent machine writes no bytecode (PYTHONDONTWRITEBYTECODE=1; 2026-11-29: 2240 modules compiled in one
# launch): each launch compiled expgpu's and Hydra's modules, which a node with an installed expgpu reads
# cached. Compiled once here, so that the launch benchmark compares what a user's node would run (torch's
# own stay uncompiled there, for both sides).
$PY -m compileall -q -j 0 src ${PYTHONPATH//:/ } >/dev/null 2>&1 || true
PARTS=" ${PARTS:-main tests fast bench} "
summary=()

part() {   # part GROUP NAME SECONDS CMD...: its output in OUT/NAME.log, its outcome in the summary
  [[ $PARTS == *" $1 "* ]] || return 0
  local name=$2 limit=$3; shift 3
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$OUT/$name.log"
  summary+=("$name: rc=$rc in $((SECONDS - t0)) s")
}

{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,power.draw --format=csv
  $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.is_available())"; nproc; } 2>&1 | tee "$OUT/machine.log"

run_dir=$(mktemp -d)
part main main_fp32 120 $PY -m expgpu task=a gpu_map=ranked task.max_steps=300 hydra.run.dir="$run_dir/fp32"
cp "$run_dir/fp32/result.json" "$OUT/main_fp32.result.json" 2>/dev/null
part main main_bf16 120 $PY -m expgpu task=a gpu_map=ranked task.max_steps=300 task.precision=bf16 \
  hydra.run.dir="$run_dir/bf16"
part main main_fsdp 120 $PY -m expgpu task=a gpu_map=ranked task.max_steps=100 launch.wrap=fsdp backend=nccl \
  hydra.run.dir="$run_dir/fsdp"
part tests tests_gpu 300 $PY -m pytest -q -rs -m gpu -p no:cacheprovider --timeout 280 tests/e2e/test_gpu.py tests/gpus \
  tests/pool/test_gpu_pool.py tests/pool/test_gpu_sharing.py tests/pool/test_busy_gpus.py tests/launch/test_run_leases.py tests/script/test_script_examples.py tests/slurm/test_slurm_submit.py tests/loggers/test_metrics.py
# Before the benchmarks: what must pass comes first. -v: a line per test as it ends, so a log cut off at the
# part's limit still names each failure (-q's dots did not, 2026-11-27); --durations: what took long there.
part fast fast_tier 240 $PY -m pytest -v -rfE --durations=15 --maxfail=40 -n 8 -p no:cacheprovider \
  -m "not slow and not slurm and not gpu" --timeout 120
part bench bench_run_api_gpu 240 $PY bench/bench_run_api.py --gpu --nproc 1 --rounds 3 --steps 3000 --control
# the same with a step the GPU's work decides (~5 ms): a loop that waits for the GPU idles it
part bench bench_run_api_gpu_bound 200 $PY bench/bench_run_api.py --gpu --nproc 1 --rounds 3 --steps 600 --chunk 50 \
  --control +task.hidden=16384
part bench bench_startup_gpu 150 $PY bench/bench_ddp_overhead.py --gpu --nproc 1 --rounds 0 --launches 3 \
  --launch-steps 300
# several small jobs on one GPU at once (hydra.launcher.jobs_per_gpu) against one at a time
part bench bench_gpu_sharing 150 $PY bench/bench_gpu_sharing.py --jobs 8 --steps 1500 --shares 1,4 --rounds 1
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.log"
