"""hydra/launcher=gpu_pool: what each job's process is: its share of the cores, the task module imported once
ahead of the jobs (the fork server), the jobs' atexit handlers, priming and the user's callbacks, and one
fork server for all of an optimizing sweep's batches. With the sleeping task of tests/helpers/pool_sweep.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hydra_optuna import hydra_optuna, with_path  # noqa: F401  (a fixture)
from pool_sweep import Sweep, all_leases_free, report_rows, simulate

from conftest import clean_env, expgpu


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_job_gets_its_share_of_the_cores_unless_the_user_chose(tmp_path):
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 2)
    # Nobody set OMP_NUM_THREADS: 2 slots share the cores.
    sweep = Sweep(tmp_path, "budget", OMP_NUM_THREADS=None, MKL_NUM_THREADS=None)
    done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.tag=range(4)", "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert f"{share} thread{'s' if share > 1 else ''} per job ({cores} cores, 2 jobs at once" in done.stdout
    seen = {(r["omp"], r["mkl"], r["blas"], r["torch_threads"]) for r in sweep.records()}
    assert seen == {(str(share), str(share), str(share), share)}, seen
    # hydra.launcher.threads_per_job decides
    chosen = Sweep(tmp_path, "chosen", OMP_NUM_THREADS=None)
    done = chosen.run(["task=sleep", "task.model.seconds=0", "task.model.tag=range(2)", "hydra.launcher.cpu_slots=2",
                       "hydra.launcher.threads_per_job=3"])
    assert done.returncode == 0, done.stderr
    assert "3 threads per job (hydra.launcher.threads_per_job)" in done.stdout
    assert {(r["omp"], r["torch_threads"]) for r in chosen.records()} == {("3", 3)}
    # The user's own OMP_NUM_THREADS is kept
    theirs = Sweep(tmp_path, "theirs", OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS=None)
    done = theirs.run(["task=sleep", "task.model.seconds=0", "task.model.tag=range(2)", "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert "threads per job as set (OMP_NUM_THREADS=2)" in done.stdout
    assert {(r["omp"], r["torch_threads"]) for r in theirs.records()} == {("2", 2)}
    # OPENBLAS_NUM_THREADS alone (numpy's) is kept, and does not stand for torch's threads
    blas = Sweep(tmp_path, "blas", OMP_NUM_THREADS=None, MKL_NUM_THREADS=None, OPENBLAS_NUM_THREADS="7")
    done = blas.run(["task=sleep", "task.model.seconds=0", "task.model.tag=range(2)", "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert {(r["omp"], r["blas"], r["torch_threads"]) for r in blas.records()} == {(str(share), "7", share)}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_task_module_is_imported_once_per_sweep_ahead_of_the_jobs_without_starting_cuda(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=0.5", "task.model.tag=range(4)", simulate(2)])
    assert done.returncode == 0, done.stderr
    imported = {r["pid"]: r["job"] for r in sweep.records("import")}
    jobs = sweep.records()
    assert len(jobs) == 4
    # The task's module was imported once for the whole sweep, by a process without a job (-1): the
    # fork server every job's process is forked from. No job imported it again...
    assert list(imported.values()) == [-1], imported
    assert not any(j["pid"] in imported for j in jobs), (imported, [j["pid"] for j in jobs])
    # ...and CUDA was not started by it: each job's mask (set at hand-over) still counts.
    assert not any(j["cuda_initialized"] for j in jobs)
    assert {j["cvd"] for j in jobs} <= {"0", "1"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_without_the_fork_server_jobs_still_run_in_processes_started_one_by_one(tmp_path):
    # A task module that starts a thread when imported: the fork server (which imports it ahead on
    # CPU slots) must not fork with it, and the pool starts each job's process itself instead.
    sweep = Sweep(tmp_path)
    (sweep.code / "threaded_task.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
        "from pool_task import Sleep  # noqa\n")
    done = sweep.run(["task=sleep", "task.model._target_=threaded_task.Sleep", "task.model.seconds=0",
                      "task.model.tag=range(4)", "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert [j["state"] for j in sweep.pool()["jobs"]] == ["finished"] * 4
    assert sorted(r["tag"] for r in sweep.records()) == [0, 1, 2, 3]
    assert "not forking" in (sweep.dir / ".expgpu" / "pool-spares.log").read_text()

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_jobs_atexit_handlers_run_in_every_job(tmp_path):
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.at_exit=write", "task.model.tag=range(6)",
                      "hydra.launcher.cpu_slots=2"])
    assert done.returncode == 0, done.stderr
    assert sorted(r["tag"] for r in sweep.records("atexit")) == list(range(6)), "atexit ran in 6 of 6 jobs"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hanging_atexit_handler_is_cut_after_the_grace_and_named(tmp_path):
    sweep = Sweep(tmp_path, EXPGPU_ATEXIT_GRACE_S="1")
    t = time.monotonic()
    done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.at_exit=hang", "task.model.tag=0,1"], 100)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t < 60
    assert [j["state"] for j in sweep.pool()["jobs"]] == ["finished", "finished"]
    for n in (0, 1):
        console = (sweep.dir / str(n) / "console.log").read_text()
        assert "expgpu: atexit handler pool_task.hang_forever (" in console, console
        assert "did not return within 1s (EXPGPU_ATEXIT_GRACE_S); exiting without it" in console


@pytest.mark.slow
@pytest.mark.parametrize("pool", [True, False], ids=["gpu_pool", "nproc_per_node"])
def test_a_bad_atexit_grace_is_one_line_before_anything_starts(tmp_path, pool):
    sweep = Sweep(tmp_path, EXPGPU_ATEXIT_GRACE_S="ten")
    if pool:
        done = sweep.run(["task=sleep", "task.model.seconds=0", "task.model.tag=0,1"], 60)
    else:
        done = expgpu(["task=a", "task.max_steps=5", "launch.nproc_per_node=2"], tmp_path / "run",
                      env=clean_env(EXPGPU_ATEXIT_GRACE_S="ten"), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "EXPGPU_ATEXIT_GRACE_S='ten' is not allowed: seconds >= 0" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.rglob("result.json")), "nothing ran"


START_CALLBACK = '''
import json, os
from hydra.experimental.callback import Callback


class SeeStart(Callback):
    def on_job_start(self, config, **kwargs):
        with open(os.environ["POOL_TEST_LOG"], "a") as f:
            f.write(json.dumps({"event": "on_job_start", "job": int(os.environ.get("EXPGPU_POOL_JOB", "-1")),
                                "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_jobs_after_the_first_wave_are_primed_and_get_their_gpus_env_set_and_config(tmp_path):
    # A primed spare did Hydra's set-up of its job (run_job up to the task function) while the first
    # wave ran; at the hand-over it still gets the job's own GPUs and leases, and the job's
    # hydra.job.env_set still wins over the pool's variables.
    sweep = Sweep(tmp_path)
    done = sweep.run(["task=sleep", "task.model.seconds=2", "task.model.tag=range(4)", simulate(2),
                      "hydra.launcher.threads_per_job=1", "+hydra.job.env_set.MKL_NUM_THREADS=5"])
    assert done.returncode == 0, done.stderr
    pool = {j["num"]: j for j in sweep.pool()["jobs"]}
    by_start = sorted(pool.values(), key=lambda j: j["started"])
    assert [j["primed"] for j in by_start] == [False, False, True, True], by_start
    for r in sweep.records():
        job = pool[r["job"]]
        assert r["cvd"] == r["lease"] == ",".join(map(str, job["gpus"])), (r, job)
        assert (r["omp"], r["mkl"], r["torch_threads"]) == ("1", "5", 1), r
        assert (sweep.dir / str(r["job"]) / ".hydra" / "overrides.yaml").read_text().count(f"task.model.tag={r['tag']}")
        assert json.loads((sweep.dir / str(r["job"]) / "result.json").read_text())["status"] == "finished"
    assert sorted(r["tag"] for r in sweep.records()) == [0, 1, 2, 3]
    all_leases_free(sweep, 2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_users_on_job_start_callback_turns_priming_off(tmp_path):
    # Its on_job_start must see the job as started: its own job number and GPUs, not a spare's.
    sweep = Sweep(tmp_path)
    (sweep.code / "start_callback.py").write_text(START_CALLBACK)
    done = sweep.run(["task=sleep", "task.model.seconds=1", "task.model.tag=range(4)", simulate(2),
                      "+hydra.callbacks.see._target_=start_callback.SeeStart"])
    assert done.returncode == 0, done.stderr
    pool = {j["num"]: j for j in sweep.pool()["jobs"]}
    assert not any(j["primed"] for j in pool.values())
    seen = sweep.records("on_job_start")
    assert sorted(r["job"] for r in seen) == [0, 1, 2, 3]
    for r in seen:
        assert r["cvd"] == ",".join(map(str, pool[r["job"]]["gpus"])), r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_optimizing_sweep_keeps_its_batches_in_order_and_warms_one_fork_server_for_all(tmp_path, hydra_optuna):
    # Hydra's optuna sweeper with n_jobs=1 calls launch() once per trial: 3 batches of 1 job each, in pool.json
    # in order. The task's module (and torch) is imported once, by one fork server kept from batch to batch,
    # not once per trial; and it is gone at the end.
    sweep = Sweep(tmp_path)
    sweep.env = with_path(sweep.env, hydra_optuna)
    done = sweep.run(["task=sleep", "task.model.seconds=0", "objective=final_loss", "hydra/sweeper=optuna",
                      "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1", "hydra.sweeper.sampler.seed=0",
                      "task.optimizer.lr=interval(0.001,0.1)", "hydra.launcher.cpu_slots=2"], 280)
    assert done.returncode == 0, done.stderr[-3000:]
    pool = sweep.pool()
    assert [(j["num"], j["state"], Path(j["dir"]).name) for j in pool["jobs"]] == \
        [(0, "finished", "0"), (1, "finished", "1"), (2, "finished", "2")]
    assert pool["batches"] == [{"batch": 0, "jobs": [0]}, {"batch": 1, "jobs": [1]}, {"batch": 2, "jobs": [2]}]
    assert [row[1] for row in report_rows(sweep)] == ["finished"] * 3
    assert [r["job"] for r in sweep.records("import")] == [-1], sweep.records("import")
    assert len(sweep.records()) == 3
    # the kept server's state is tidied when the sweep ends; the sweep's process record stays (expgpu.status.busy)
    assert sorted(p.name for p in (sweep.dir / ".expgpu").iterdir()) == ["process.json", "process.lock"]
