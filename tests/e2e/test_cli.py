"""The CLI end to end on CPU: real processes, a real gloo process group."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from conftest import HELPERS, REPO, TESTS, clean_env, expgpu
from expgpu import envvars, procs

MIXED_NODE = ("inventory.simulate=[{name:V100,memory_mb:16384},{name:H100,memory_mb:81559},"
              "{name:T4,memory_mb:15360},{name:A100,memory_mb:40960}]")


@pytest.mark.slow
def test_single_rank_trains_and_writes_result(tmp_path):
    # The main job as a user starts it: no warm server (conftest.clean_env), trained in the launcher.
    run = expgpu(["task=a", "task.max_steps=60", "gpu_map=ranked"], tmp_path / "run",
                 env=clean_env(EXPGPU_WARM_SERVER=""))
    assert run.returncode == 0, run.stderr
    res = run.result
    assert res["status"] == "finished" and res["source"] == "single" and res["world_size"] == 1
    assert res["backend"] is None and "no process group" in run.output  # one rank makes none
    assert res["steps"] == 60 and res["plan"][0]["device"] == "cpu"
    losses = [m["loss"] for m in run.metrics()]
    assert losses[-1] < 0.5 * losses[0], losses
    assert res["timing"]["steps_per_s"] > 0 and res["timing"]["startup_s"] > 0
    assert "rank 0/1 on" in run.output and "-> cpu" in run.output
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()


@pytest.mark.slow
def test_a_run_whose_loss_diverges_says_so_and_its_result_keeps_the_step(tmp_path):
    run = expgpu(["task=a", "task.max_steps=30", "task.optimizer.lr=1e8"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert run.result["status"] == "finished" and run.result["nonfinite"] == {"loss": 10}, run.result
    assert run.output.count("loss is nan at step 10, the first logged value of it") == 1, run.output
    fine = expgpu(["task=a", "task.max_steps=30"], tmp_path / "fine")
    assert fine.returncode == 0 and "nonfinite" not in fine.result and "not a finite number" not in fine.output


@pytest.mark.slow
def test_under_on_nonfinite_stop_a_diverged_run_ends_on_every_rank_at_once_as_diverged(tmp_path):
    # Keras's TerminateOnNaN, Lightning's check_finite: both ranks stop at one step soon after the nan row, save
    # nothing (the parameters are nan), and the run exits 0 as `diverged`, final (no requeue, no resume)
    run = expgpu(["task=a", "task.max_steps=20000", "task.optimizer.lr=1e8", "task.on_nonfinite=stop",
                  "launch.nproc_per_node=2"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    res = run.result
    assert (res["status"], res["stop_signal"], res["nonfinite"]) == ("diverged", "DIVERGED", {"loss": 10}), res
    assert 10 <= res["steps"] < 20000 and len(set(res["rank_checksums"])) == 1, res
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
    assert run.output.count("stopping every rank (task.on_nonfinite=stop): the run ends as diverged") == 1, run.output
    assert f"diverged: stopped at step {res['steps']} (task.on_nonfinite=stop; loss nan or inf from step 10)" \
        in run.output
    bad = expgpu(["task=a", "task.on_nonfinite=halt"], tmp_path / "bad")
    assert bad.returncode == 2 and "expgpu: error: task.on_nonfinite='halt' is not allowed: continue or stop" \
        in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.slow
def test_without_a_terminal_progress_is_a_line_every_few_seconds_and_the_last_row(tmp_path):
    # A row every step in metrics.jsonl, but not a log line per row: the first, then one every
    # PROGRESS_EVERY_S, and the last.
    run = expgpu(["task=a", "task.max_steps=120", "task.log_every=1"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert len(run.metrics()) == 120
    lines = [ln for ln in run.output.splitlines() if re.search(r" - step \d+/120 \(\d+ %\)  loss ", ln)]
    assert 2 <= len(lines) <= 10, lines
    assert "step 1/120 (1 %)  loss" in lines[0] and "step 120/120 (100 %)  loss" in lines[-1], lines


@pytest.mark.slow
def test_two_local_ranks_hold_identical_parameters(tmp_path):
    run = expgpu(["task=b", "task.max_steps=40", "launch.nproc_per_node=2"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    res = run.result
    assert res["world_size"] == 2 and res["source"] == "local" and res["backend"] == "gloo"
    assert len(res["rank_checksums"]) == 2
    assert res["rank_checksums"][0] == res["rank_checksums"][1] == res["param_checksum"]
    losses = [m["loss"] for m in run.metrics()]
    assert losses[-1] < losses[0]
    assert "rank 1/2 on" in run.output
    assert {r["rank"] for r in res["plan"]} == {0, 1}


@pytest.mark.slow
def test_digits_reaches_test_accuracy(tmp_path):
    run = expgpu(["task=digits"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert run.result["metrics"]["accuracy"] > 0.9


def _descendants_alive(run_dir: str) -> list:
    """Processes of the run still alive: named by their command line (a fresh rank's) or by a file
    they hold open in the run dir (a forked rank keeps its server's command line, but its log)."""
    alive = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if run_dir in " ".join(p.info["cmdline"] or []) or any(
                    f.path.startswith(run_dir + os.sep) for f in p.open_files()):
                alive.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["exception", "kill"])
def test_a_crashing_rank_ends_the_group_quickly(tmp_path, kind):
    run_dir = tmp_path / f"crash-{kind}"
    t0 = time.monotonic()
    run = expgpu(["task=a", "task.max_steps=100000", "launch.nproc_per_node=2", "faults.crash_rank=1",
                  "faults.crash_step=20", f"faults.kind={kind}", "backend.timeout_s=30"], run_dir, timeout=120)
    elapsed = time.monotonic() - t0
    assert run.returncode == 1, (run.returncode, run.stderr)
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("expgpu: rank 1 failed:"), last
    both = run.stdout + run.stderr
    # its peer's echo (a collective torn down) is one line naming rank 1, not a traceback of its own
    assert "rank 0: stopping: rank(s) 1 failed (their error is their own record)" in both
    if kind == "exception":
        assert "injected crash" in last
        assert both.count("Traceback") == 1, both   # the cause's, once
    else:
        assert "SIGKILL" in last
        assert "Traceback" not in both, both   # killed outright, it printed none; its peer waited to know why
    assert elapsed < 30, elapsed
    assert not _descendants_alive(str(run_dir)), "workers outlived the run"


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "expgpu"]
    run = expgpu(["task=a", "task.max_steps=30"], run_dir, cmd=cmd)
    assert run.returncode == 0, run.stderr
    res = run.result
    assert res["source"] == "torchrun" and res["world_size"] == 2
    assert res["rank_checksums"][0] == res["rank_checksums"][1]


@pytest.mark.slow
def test_two_processes_given_slurm_variables(tmp_path):
    """What srun -n2 gives each task (the test plays srun); both share one run dir."""
    procs, port = [], str(_free_port())
    for rank in range(2):
        env = clean_env(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_NTASKS="2",
                        SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NNODES="1",
                        SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                        SLURM_STEP_NODELIST="localhost", SLURM_STEP_NUM_TASKS="2",
                        SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NUM_NODES="1",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "expgpu", "task=a", "task.max_steps=30"],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        time.sleep(1.0 * rank)  # ranks start apart, as on a real cluster
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    run_dir = tmp_path / "outputs" / "slurm" / "4242"
    res = json.loads((run_dir / "result.json").read_text())
    assert res["source"] == "slurm" and res["world_size"] == 2
    assert res["rank_checksums"][0] == res["rank_checksums"][1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dry_run_prints_plan_without_training(tmp_path):
    run = expgpu(["dry_run=true", "gpu_map=ranked", "launch.nproc_per_node=2", MIXED_NODE], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "gpu_map=ranked"
    rows = [line.split() for line in lines[2:4]]
    assert rows[0][0] == "0" and rows[0][3] == "1" and rows[0][4] == "H100"
    assert rows[1][0] == "1" and rows[1][3] == "3" and rows[1][4] == "A100"
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [r["gpus"] for r in plan["ranks"]] == [[1], [3]]
    assert not (tmp_path / "run" / "result.json").exists()
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_dry_run_never_imports_torch(tmp_path):
    code = ("import sys, runpy; sys.argv=['expgpu','dry_run=true','hydra.run.dir=" + str(tmp_path / "r") + "'];"
            "import atexit; atexit.register(lambda: print('TORCH' if 'torch' in sys.modules else 'NOTORCH'));"
            "runpy.run_module('expgpu', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("NOTORCH")


@pytest.mark.slow
def test_a_dry_run_checks_a_task_functions_keys_as_its_ranks_would(tmp_path):
    (tmp_path / "my_tasks.py").write_text("import torch\n\n\ndef train(run, lr: float = 1e-3):\n    return {}\n")
    (tmp_path / "conf" / "task").mkdir(parents=True)
    (tmp_path / "conf" / "task" / "mine.yaml").write_text("_target_: my_tasks.train\n_partial_: true\n")
    args = ["--config-dir", str(tmp_path / "conf"), "task=mine", "dry_run=true"]
    ok = expgpu(args, tmp_path / "ok", cwd=tmp_path)   # the launch dir's module, imported from there
    assert ok.returncode == 0 and (tmp_path / "ok" / "plan.json").exists(), ok.stderr
    bad = expgpu([*args, "task.lrr=0.1"], tmp_path / "bad", cwd=tmp_path)
    said = [line for line in bad.stderr.splitlines() if line.startswith("expgpu")]
    assert bad.returncode == 2 and said == [
        "expgpu: error: task.lrr: my_tasks.train takes no parameter 'lrr' (did you mean task.lr?); it takes lr (and "
        "the run's keys name, seed, seed_per_rank, log_every, log_reduce, precision, on_nonfinite)"], bad.stderr
    assert not (tmp_path / "bad" / "plan.json").exists()


@pytest.mark.slow
def test_user_task_from_own_config_dir(tmp_path):
    env = clean_env(PYTHONPATH=str(REPO / "examples"))
    run = expgpu(["--config-dir", str(REPO / "examples" / "conf"), "task=linreg"], tmp_path / "run", env=env)
    assert run.returncode == 0, run.stderr
    assert run.result["task"] == "linreg" and run.result["metrics"]["final_loss"] < 0.05


@pytest.mark.parametrize("args, needle", [
    (["task.batch_sise=3"], "task.batch_sise: expgpu.tasks.supervised.train takes no parameter 'batch_sise' "
                            "(did you mean task.batch_size?); it takes model, dataset, optimizer, batch_size, "
                            "max_steps, loss, eval_dataset"),
    (["task.lr=0.1"], "takes no parameter 'lr' (did you mean task.optimizer.lr?); it takes model"),
    (["gpu_map.strategi=ranked"], "gpu_map.strategi: unknown key; allowed under gpu_map: strategy, gpus"),
    (["task.model.hiden=3"], "task.model.hiden: expgpu.tasks.models.MLP takes no parameter 'hiden' (did you mean "
                             "task.model.hidden?); it takes in_features, out_features, hidden, depth"),
    (["+task.optimizer.momentum=0.9"], "task.optimizer.momentum: torch.optim.Adam takes no parameter 'momentum'; "
                                       "it takes params, lr, betas"),
    (["task.optimizer._target_=torch.optim.SGDD"], "torch.optim has no attribute 'SGDD'"),
    (["task.batch_size=abc"], "task.batch_size"),
    (["task=nope"], "task/nope"),
    (["experiment=short"], "experiment=short: no experiment/ group on the config search path; an experiment is a "
                           "file experiment/short.yaml (first line `# @package _global_`) in a dir of your own, "
                           "given with --config-dir (python -m expgpu --config-dir my_conf experiment=short)"),
    (["gpu_map=ranked", "gpu_map.strategy=fastest"], "gpu_map.strategy"),
    (["task.batch_size=0"], "task.batch_size=0"),
    (["task.steps=100", "dry_run=true"], "task.steps: expgpu.tasks.supervised.train takes no parameter 'steps' (did "
                                         "you mean task.max_steps?)"),   # a dry run checks the task's keys too
    (["task.model.hiden=3", "dry_run=true"], "task.model.hiden: expgpu.tasks.models.MLP takes no parameter 'hiden'"),
    (["gpu_map=custom", "gpu_map.gpus=[0,0]", "launch.nproc_per_node=2", "dry_run=true",
      "inventory.simulate=[{name:A100,memory_mb:40960},{name:A100,memory_mb:40960}]"], "gpu_map.gpus"),
    (["gpu_map=custom", "gpu_map.gpus=[5]", "dry_run=true",
      "inventory.simulate=[{name:A100,memory_mb:40960}]"], "gpu_map.gpus"),
    (["inventory.simulate=[{name:A100}]", "dry_run=true"], "inventory.simulate[0].memory_mb"),
    (["backend=nccl"], "backend=nccl"),
    (["task.model._target_=torch.nn.Nope"], "task.model"),
    (["launch.isolation=magic"], "launch.isolation"),
    (["checkpoint.poll_every=0"], "checkpoint.poll_every=0 is not allowed: auto or an integer >= 1"),
    (["checkpoint.poll_every=often"], "checkpoint.poll_every='often' is not allowed: auto or an integer >= 1"),
    (["launch.max_restarts=-1"], "launch.max_restarts=-1 is not allowed: an integer >= 0"),
    (["launch.on_hang=restart"], "launch.on_hang=restart is not allowed: fail, or restart with launch.max_restarts "
                                 ">= 1"),
    (["launch.nodes=2"], "launch.nodes=2 is not allowed here: it spreads a hydra/launcher=gpu_pool job over that "
                         "many nodes of a SLURM allocation, and this run has 1 node(s) (single)"),
    (["faults.crash_attempts=0"], "faults.crash_attempts=0 is not allowed: null (every attempt) or an integer >= 1"),
    (["logger.wandb.project=x"], "logger.wandb.project=x: logger.wandb is null in this config, so nothing under it "
                                 "can be set; choose that logger too, e.g. logger=[csv,wandb], or drop the key"),
    # Hydra's grammar makes the inner sweep an object OmegaConf cannot hold ("tags: Unexpected type annotation")
    (["task.optimizer={lr:tag(log,interval(1e-4,1e-1))}"],
     "task.optimizer={lr:tag(log,interval(1e-4,1e-1))}: a sweep (choice, range, interval, tag) inside a {dict} or "
     "[list] is not a value Hydra can set; give each searched key an override of its own"),
    # OmegaConf nests a dotted key inside a dict: the line named hydra.sweeper.params.task.optimizer, never written
    (["-m", "hydra/sweeper=expgpu_optuna", "hydra.sweeper.params={task.optimizer.lr:'choice(0.1,0.01)'}"],
     "hydra.sweeper.params={task.optimizer.lr:'choice(0.1,0.01)'}: the dotted key 'task.optimizer.lr' inside a {dict} "
     "is read as nested keys (hydra.sweeper.params.task.optimizer.lr), not as one; give each searched key an override "
     "of its own, e.g. python -m expgpu -m 'task.optimizer.lr=...'"),
    # Hydra's basic sweeper: params null, and OmegaConf's merge of a dict into it ended in an AttributeError
    (["hydra.sweeper.params={lr:'choice(1,2)'}"],
     "hydra.sweeper.params={lr:'choice(1,2)'}: hydra.sweeper.params is null under this sweeper, and a {dict} cannot "
     "be merged into it from the command line; give each searched key an override of its own, e.g. python -m expgpu "
     "-m 'lr=...'"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    run = expgpu(args, tmp_path / "run")
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("expgpu: error:")]
    assert len(lines) == 1 and needle in lines[0], run.stderr


@pytest.mark.slow
def test_a_gpu_node_with_torchs_cpu_build_is_one_line_and_exit_2(tmp_path):
    # NVML answering as a node with one H100 (tests/helpers/one_gpu_nvml), this machine's torch a CPU build:
    # the GPU is planned, and torch could only fail at the task's first .to(device), deep in a traceback
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build: the case is torch's CPU build on a node with GPUs")
    env = clean_env(PYTHONPATH=str(HELPERS / "one_gpu_nvml"), EXPGPU_WARM_SERVER="",
                    EXPGPU_LEASE_DIR=str(tmp_path / "leases"))   # the run leases its GPU (expgpu.launch.run_leases)
    run = expgpu(["task=a", "task.max_steps=3"], tmp_path / "run", env=env)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "expgpu: error: this node has GPUs (rank 0 was planned GPU 0: NVIDIA H100 80GB HBM3), but this torch "
        f"{torch.__version__} is a CPU-only build: install a CUDA build of torch (EXPGPU_TORCH, docs/quick-start.md), "
        "or train on the CPU with CUDA_VISIBLE_DEVICES=''")
    hidden = expgpu(["task=a", "task.max_steps=3"], tmp_path / "cpu", env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert hidden.returncode == 0, hidden.stderr[-3000:]   # what the line says to do


def test_the_sbatch_script_run_outside_a_slurm_job_is_one_line_and_exit_2():
    done = subprocess.run(["bash", str(REPO / "scripts" / "expgpu.sbatch"), "task=a"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert done.stderr == ("expgpu.sbatch: error: not inside a SLURM job (SLURM_JOB_ID is not set): submit it with "
                           "sbatch scripts/expgpu.sbatch task=a; on this machine, python -m expgpu task=a\n")


def test_a_misspelt_expgpu_variable_is_one_line_naming_the_one_meant(tmp_path):
    # EXPGPU_LEASEDIR would be ignored: the run's leases in ~/.cache, where another user's sweep does not look
    run = expgpu(["task=a", "dry_run=true"], tmp_path / "run", env=clean_env(EXPGPU_LEASEDIR=str(tmp_path)))
    assert run.returncode == 2 and run.stderr.startswith(
        "expgpu: error: EXPGPU_LEASEDIR: expgpu reads no such environment variable (did you mean EXPGPU_LEASE_DIR?); "
        "those a user sets: EXPGPU_WARM_SERVER,"), run.stderr
    assert not (tmp_path / "run").exists()
    # every name expgpu's processes pass each other, and names far from any (a CI's own), are left alone
    assert envvars.misspelt({envvars.POOL_GPUS: "0", envvars.SCRIPT_HEARTBEAT: "x", "EXPGPU_REQUIRE_SLURM": "1",
                             "EXPGPU_POOL_ANYTHING": "1", "EXPGPU_TORCH": "cu124"}) is None
    assert "did you mean EXPGPU_WARM_RANKS?" in envvars.misspelt({"EXPGPU_WARM_RANK": "0"})


@pytest.mark.slow
@pytest.mark.parametrize("var, value", [("SLURM_PROCID", "x"), ("SLURM_NTASKS", "-2"), ("SLURM_PROCID", "7")])
def test_bad_environment_is_one_line_and_exit_2(tmp_path, var, value):
    env = clean_env(SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0",
                    SLURM_NODEID="0", SLURM_NNODES="1", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost")
    env[var] = value
    run = expgpu(["task=a"], tmp_path / "run", env=env)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert var in run.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("value", ["abc", "0", "4,"])
def test_a_thread_count_openmp_would_refuse_is_one_line_and_exit_2(tmp_path, value):
    # libgomp only warns ("Invalid value for environment variable OMP_NUM_THREADS") and takes a thread per core
    run = expgpu(["task=a", "task.max_steps=2"], tmp_path / "run", env={**clean_env(), "OMP_NUM_THREADS": value})
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        f"expgpu: error: environment variable OMP_NUM_THREADS='{value}' is not allowed: a number of threads >= 1")
    nested = expgpu(["task=a", "task.max_steps=2"], tmp_path / "nested", env={**clean_env(), "OMP_NUM_THREADS": "1,1"})
    assert nested.returncode == 0, nested.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("value", ["yes", "2"])
def test_a_bad_warm_ranks_variable_is_one_line_and_exit_2_before_any_rank_starts(tmp_path, value):
    run = expgpu(["task=a", "launch.nproc_per_node=2"], tmp_path / "run", env=clean_env(EXPGPU_WARM_RANKS=value))
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"expgpu: error: EXPGPU_WARM_RANKS='{value}' is not allowed: 1 (the default: a launch's ranks are forked "
        "from one process that imported torch) or 0 (each rank starts fresh); unset it or fix it")
    assert not (run.run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_ranks_forked_from_the_warm_process_run_as_fresh_ones_do(tmp_path):
    """launch.nproc_per_node=2 forks its ranks from one process that imported torch: each has its own
    environment and argv, and torch's threads follow the OMP_NUM_THREADS spawn gave it (OpenMP read
    the server's at import); EXPGPU_WARM_RANKS=0 starts them fresh, with the same outcome."""
    base = ["--config-dir", str(TESTS / "conf"), "task=probe_process", "launch.nproc_per_node=2"]
    seen = {}
    for warm, omp in (("1", None), ("1", "2"), ("0", None)):
        env = clean_env(PYTHONPATH=str(HELPERS), EXPGPU_WARM_RANKS=warm)
        env.pop("OMP_NUM_THREADS")
        if omp:
            env["OMP_NUM_THREADS"] = omp
        run = expgpu(base, tmp_path / f"warm{warm}-{omp}", env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        seen[warm, omp] = [json.loads((run.run_dir / f"process{r}.json").read_text()) for r in (0, 1)]
    threads = str(max(1, procs.cores() // 2))   # what spawn gives each of 2 workers
    for (warm, omp), ranks in seen.items():
        for rank, got in enumerate(ranks):
            assert got["forked"] == (warm == "1") and got["rank_env"] == str(rank), got
            assert got["omp"] == (omp or threads) and got["threads"] == int(omp or threads), got
            assert got["argv"][-1] == str(tmp_path / f"warm{warm}-{omp}"), got
