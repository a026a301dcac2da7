"""Script tasks end to end with tests/scripts/probe_script.py (a torchrun-style script without torch, so
each run takes about a second): what each rank's script sees, where it runs, failures, stops and
resume, expgpu.log, the dry run, gpu_pool and torchrun. The published scripts: test_script_examples.py."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, expgpu, finish
from expgpu.loggers.progress import FIELDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CONF = ["--config-dir", str(REPO / "tests" / "conf")]
SIM4 = ("inventory.simulate=[{name:T4,memory_mb:16384},{name:H100,memory_mb:81920},{name:A100,memory_mb:40960},"
        "{name:V100,memory_mb:16384}]")


def started(run_dir: Path, rank: int = 0) -> dict:
    return json.loads((run_dir / f"started-rank{rank}.json").read_text())


def one_error_line(run) -> str:
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("expgpu:")]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    return lines[0]


def test_one_process_runs_the_script_as_python_would_in_its_run_dir(tmp_path):
    run = expgpu([*CONF, "task=script_probe", "task.args.log=true", "task.args.lr=0.5", "objective=val_loss",
                  "inventory.simulate=[{name:A100,memory_mb:40960}]"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    seen = started(run.run_dir)
    assert seen["cwd"] == str(run.run_dir)                     # outputs land in the run dir
    assert seen["env"]["RANK"] is None and seen["env"]["MASTER_PORT"] is None   # a world of one: plain python
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "0"          # its planned GPU, and only that
    assert seen["argv"] == ["--steps", "3", "--log", "--lr", "0.5"]
    assert "rank 0: done 3 steps" in run.stdout                # the script's output on the console ...
    assert "rank 0: done 3 steps" in (run.run_dir / "logs" / "rank0.script.log").read_text()   # ... and kept
    rows = run.metrics()
    assert [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows] == \
        [(1, 0.5, None), (2, 0.25, None), (3, 0.5 / 3, None), (3, None, 0.05)]
    assert {"step", "loss", "epoch", "time"} <= set(rows[0]) <= {"step", "loss", "epoch", "time", *FIELDS}   # run.log's
    res = run.result
    assert (res["status"], res["exit_codes"], res["steps"]) == ("finished", [0], 3)
    assert res["metrics"] == {"loss": 0.5 / 3, "val_loss": 0.05}
    csv_rows = (run.run_dir / "metrics.csv").read_text().splitlines()   # logger=csv got the rows too
    assert csv_rows[0] == "step,loss,val_loss,epoch,time" and len(csv_rows) == 5

    missing = expgpu([*CONF, "task=script_probe", "objective=accuracy"], tmp_path / "run2")
    assert "objective=accuracy: the task returned no metric 'accuracy'" in one_error_line(missing)


@pytest.mark.parametrize("isolation, gpu_map, masks", [
    ("auto", ["gpu_map=ranked"], ["1,2", "1,2"]),
    ("visible_devices", ["gpu_map=ranked"], ["1", "2"]),
    ("auto", ["gpu_map.gpus_per_rank=2"], ["0,1,2,3", "0,1,2,3"]),
], ids=["auto", "visible_devices", "two_gpus_per_rank"])
def test_two_ranks_get_torchrun_variables_and_their_gpus(tmp_path, isolation, gpu_map, masks):
    run = expgpu([*CONF, "task=script_probe", "launch.nproc_per_node=2", f"launch.isolation={isolation}", SIM4,
                  *gpu_map], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    env = [started(run.run_dir, r)["env"] for r in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == masks
    for r, e in enumerate(env):
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"],
                e["GROUP_WORLD_SIZE"], e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) == (str(r), str(r), "2", "2", "0", "1",
                                                                                str(r), "2")
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "False" and e["EXPGPU_RANK"] is None
        assert e["OMP_NUM_THREADS"] == "1"
    # one port for both, chosen before they started, for the script's own init_process_group
    assert env[0]["MASTER_ADDR"] == env[1]["MASTER_ADDR"] == "127.0.0.1"
    assert env[0]["MASTER_PORT"] == env[1]["MASTER_PORT"] and int(env[0]["MASTER_PORT"]) > 0
    assert run.result["exit_codes"] == [0, 0]
    assert [p["gpus"] for p in run.result["plan"]] == ([[1], [2]] if "ranked" in gpu_map[0] else [[0, 1], [2, 3]])


def test_a_failing_rank_ends_the_others_and_is_named_with_its_code_and_stderr(tmp_path):
    t0 = time.monotonic()
    run = expgpu([*CONF, "task=script_probe", "launch.nproc_per_node=2", "task.args.fail-rank=1",
                  "task.args.fail-code=3", "task.args.steps=300", "task.args.step-s=0.2"], tmp_path / "run")
    took = time.monotonic() - t0
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("expgpu: rank 1 failed: its script exited with code 3; the last lines of its stderr: "
                           "Traceback (most recent call last): | ValueError: injected failure"), line
    assert str(run.run_dir / "logs" / "rank1.script.log") in line
    assert took < 20, took   # rank 0 alone would run 60 s
    res = run.result
    assert res["status"] == "failed" and res["exit_codes"] == [143, 3] and res["stop_signal"] is None
    assert "ValueError: injected failure" in (run.run_dir / "logs" / "rank1.script.log").read_text()


def test_a_rank_that_exits_0_early_is_named_not_the_rank_whose_collective_lost_it(tmp_path):
    run = expgpu([*CONF, "task=script_early_exit", "launch.nproc_per_node=2"], tmp_path / "run")
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    # Now and then (1 run in several hundred here, under load) rank 1's exit aborts amid gloo's threads
    # (SIGABRT): then its own line says so (expgpu.script.result.torn_down), naming it all the same.
    assert line == (
        "expgpu: rank 1 failed: its process ended (code 0) while rank 0 still trained: its task ended on that rank "
        "alone (an early exit decided there: sys.exit(0) in a script, os._exit(0)), and rank 0's next collective "
        f"lost it (all its output: {run.run_dir / 'logs' / 'rank1.script.log'})") or line.startswith(
        "expgpu: rank 1 failed: its script's process aborted as it exited, its Python code done with no traceback "
        "(SIGABRT, 'terminate called without an active exception': torch's gloo threads still running at the exit):"
        " where the other ranks still trained, their next collective lost it, so an early exit (sys.exit(0)) must be "
        "decided on every rank together"), line


@pytest.mark.parametrize("alone_s, waited", [(9, r"rank 1's script ran on for \d+ s"),
                                              (60, r"rank 1's script still ran 10 s later")])
def test_a_collective_timeout_names_the_rank_whose_script_worked_alone_not_its_echo(tmp_path, alone_s, waited):
    """Rank 1 works alone past the group's timeout: rank 0's collective times out; rank 1's, later, loses rank 0
    (its echo, recorded first: rank 0 waits for its peers' ends). The line is rank 0's, naming rank 1; past the
    10 s expgpu waits for a peer's end, rank 1 is stopped (the run takes far less than its 60 s)."""
    t0 = time.monotonic()
    run = expgpu([*CONF, "task=script_alone", "launch.nproc_per_node=2", "task.args.timeout-s=3",
                  f"task.args.alone-s={alone_s}"], tmp_path / "run")
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"expgpu: rank 0 failed: its script's collective timed out \(RuntimeError: Timed out waiting "
                        rf"3000ms for (recv|send) operation to complete\) while {waited}: work one rank does alone "
                        r"\(an evaluation, a save or a download on rank 0 only\) must end within the process group's "
                        r"timeout \(init_process_group\(timeout=\.\.\.\) in the script\) while the others wait: raise "
                        r"it above that work's length, or share the work out over every rank \(all its output: .*"
                        r"rank0\.script\.log\)", line), line
    assert time.monotonic() - t0 < 50


def _wait_for_step(proc, run_dir: Path, step: int, ranks=(0, 1), timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(int((run_dir / f"at-rank{r}").read_text() or 0) >= step for r in ranks):
                return
        except (OSError, ValueError):
            pass
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    pytest.fail(f"the scripts did not reach step {step}")


def _start(args: list[str], run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "expgpu", *args, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_sigterm_to_the_launcher_stops_every_script_and_a_rerun_adds_resume_args(tmp_path):
    run_dir = tmp_path / "run"
    # 200 steps of 0.2 s, a kill grace of 60 s: a stop that worked ends in seconds, far from either
    args = [*CONF, "task=script_probe_resume", "launch.nproc_per_node=2", "task.args.log=true",
            "logger=[csv,tensorboard]", "task.args.steps=200", "task.grace_s=60"]
    proc = _start(args, run_dir)
    _wait_for_step(proc, run_dir, 3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)   # the launcher's pid alone
    run = finish(proc, run_dir)
    assert time.monotonic() - t0 < 30   # not the script's end (40 s), not the grace's SIGKILL (60 s)
    assert run.returncode == 143, run.stderr
    res = run.result
    assert (res["status"], res["stop_signal"], res["exit_codes"]) == ("stopped", "SIGTERM", [143, 143])
    assert "the script stopped on SIGTERM" in run.stderr and f"hydra.run.dir={run_dir}" in run.stderr
    saved = int((run_dir / "ckpt.txt").read_text())
    assert "saved step" in (run_dir / "logs" / "rank1.script.log").read_text()

    again = expgpu(args + ["task.args.steps=8"], run_dir)   # the same run dir: the script resumes
    assert again.returncode == 0, again.stderr
    for rank in (0, 1):
        assert started(run_dir, rank)["argv"][-1] == "--resume"
        assert started(run_dir, rank)["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert json.loads((run_dir / f"done-rank{rank}.json").read_text()) == {"steps": 8, "first": saved}
    assert again.result["resumed"] is True and again.result["status"] == "finished"
    # expgpu.log's history goes on where the resumed script goes on: every step once, in the loggers too
    assert [r["step"] for r in again.metrics() if "loss" in r] == list(range(1, 9))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 9))

    kept = expgpu(args + ["task.args.steps=8"], run_dir)   # finished: kept, the script does not run again
    assert kept.returncode == 0 and "already holds this task's finished run" in kept.stderr
    assert "rank 0: done" not in kept.stdout


def test_a_stop_before_the_first_checkpoint_reruns_without_resume_args(tmp_path):
    run_dir = tmp_path / "run"
    args = [*CONF, "task=script_probe_resume", "task.args.on-term=default"]   # dies on SIGTERM: no ckpt.txt
    proc = _start(args, run_dir)
    _wait_for_step(proc, run_dir, 1, ranks=(0,))
    proc.send_signal(signal.SIGTERM)
    run = finish(proc, run_dir)
    assert run.returncode == 143 and run.result["exit_codes"] == [143] and not (run_dir / "ckpt.txt").exists()
    again = expgpu(args + ["task.args.steps=2"], run_dir)
    assert again.returncode == 0, again.stderr
    assert "--resume" not in started(run_dir)["argv"] and again.result["resumed"] is False


def test_a_script_that_ignores_sigterm_is_killed_after_its_grace_period(tmp_path):
    run_dir = tmp_path / "run"
    # 200 steps of 0.2 s (40 s), a grace of 1 s: the SIGKILL after it ends the run in seconds, far from the
    # script's own end (its exit codes, 137 not 0, say which it was)
    proc = _start([*CONF, "task=script_probe_resume", "task.args.on-term=ignore", "task.grace_s=1",
                   "task.args.steps=200", "launch.nproc_per_node=2"], run_dir)
    _wait_for_step(proc, run_dir, 2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    run = finish(proc, run_dir)
    assert 1 <= time.monotonic() - t0 < 25
    assert run.returncode == 143, run.stderr
    assert run.result["status"] == "stopped" and run.result["exit_codes"] == [137, 137]   # SIGKILLed


def test_dry_run_shows_each_ranks_command_and_gpus(tmp_path):
    run = expgpu([*CONF, "task=script_probe", "dry_run=true", "launch.nproc_per_node=2", "gpu_map=ranked", SIM4,
                  "task.args.data=tests/scripts"], tmp_path / "run")
    assert run.returncode == 0, run.stderr
    command = f"{sys.executable} {REPO}/tests/scripts/probe_script.py --steps 3 --data {REPO}/tests/scripts"
    assert f"rank 0: CUDA_VISIBLE_DEVICES=1,2 {command}" in run.stdout
    assert f"rank 1: CUDA_VISIBLE_DEVICES=1,2 {command}" in run.stdout
    assert "H100" in run.stdout and not (tmp_path / "run" / "started-rank0.json").exists()


def test_a_module_runs_with_the_launch_dir_on_pythonpath_and_inputs_linked(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(
        "import os, sys\nopen('seen.txt', 'w').write(os.getcwd() + '\\n' + open('data/x.txt').read() + '\\n'"
        " + ' '.join(sys.argv[1:]))\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("input")
    run = expgpu([*CONF, "task=script_probe", "~task.script", "+task.module=pkg.train", "+task.inputs=[data]",
                  "task.args.steps=1"], tmp_path / "run", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "run" / "seen.txt").read_text() == f"{tmp_path / 'run'}\ninput\n--steps 1"
    assert (tmp_path / "run" / "data").resolve() == tmp_path / "data"


def test_a_file_opened_relative_to_the_launch_dir_gets_the_inputs_entry_that_fixes_it(tmp_path):
    """nanoGPT's `exec(open('configurator.py').read())` and its data/, from a task file that lists no inputs."""
    (tmp_path / "train.py").write_text("import numpy\nprint(open('data/shakespeare/train.bin').read())\n")
    (tmp_path / "data" / "shakespeare").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare" / "train.bin").write_text("tokens")
    (tmp_path / "configurator.py").write_text("")
    run = expgpu([*CONF, "task=script_probe", f"task.script={tmp_path / 'train.py'}", "task.args=null"],
                 tmp_path / "run", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    said = [ln for ln in run.stderr.splitlines() if ln.startswith("expgpu: rank 0 failed")]
    assert len(said) == 1 and said[0].endswith(
        f". The script runs in its run dir, where data/shakespeare/train.bin is not, but the launch dir has it "
        f"({tmp_path / 'data/shakespeare/train.bin'}): add `inputs: [data]` to the task's file (or "
        "task.inputs=[data]) to link it there"), run.stderr
    # with inputs listed it runs, and the hint names the entries already there with the one to add
    (tmp_path / "train.py").write_text("open('data/shakespeare/train.bin').read()\n"
                                       "exec(open('configurator.py').read())\n")
    run = expgpu([*CONF, "task=script_probe", f"task.script={tmp_path / 'train.py'}", "task.args=null",
                  "+task.inputs=[data]"], tmp_path / "run2", cwd=tmp_path)
    assert run.returncode == 1 and "add `inputs: [data, configurator.py]` to the task's file" in run.stderr, \
        run.stderr


def test_bad_input_is_one_line_before_any_rank_starts(tmp_path):
    for args, says in (
        (["task.script=nope.py"], "task.script=nope.py: "),
        (["task.args_style=posix"], "task.args_style='posix' is not allowed"),
        (["+task.module=no_such_mod"], "name one of them"),
        (["+task._target_=my.train"], "a task is a function (_target_) or a script"),
        (["task.lr=0.1"], "did you mean task.args.lr?"),
    ):
        run = expgpu([*CONF, "task=script_probe", "launch.nproc_per_node=2", *args], tmp_path / "run")
        assert run.returncode == 2, run.stderr
        assert one_error_line(run).startswith("expgpu: error: ") and says in run.stderr
        assert not list((tmp_path / "run").glob("started-rank*.json"))


def test_arguments_the_scripts_parser_refuses_are_one_line_exit_2_and_never_restarted(tmp_path):
    # argparse's refusal of a task.args value is the user's input, as expgpu's own refusal of a key is
    run = expgpu([*CONF, "task=script_probe", "launch.nproc_per_node=2", "launch.max_restarts=2",
                  "task.args.lr=fast"], tmp_path / "run")
    assert run.returncode == 2, run.stderr
    line = one_error_line(run)
    assert line.startswith("expgpu: error: task.args: the script refused its arguments: probe_script.py: error: "
                           "argument --lr: invalid float value: 'fast' (its arguments, from task.args: --steps 3 "
                           "--lr fast); its usage: "), line
    assert "restarting" not in run.stderr and not (run.run_dir / ".expgpu" / "attempts.json").exists()
    # both ranks refuse, but the first refusal may stop the other rank before its script starts (exit code
    # null: not known; CI saw [None, 2] on a loaded machine)
    codes = run.result["exit_codes"]
    assert run.result["status"] == "failed" and 2 in codes and set(codes) <= {2, None}, codes
    assert "usage: probe_script.py" in (run.run_dir / "logs" / f"rank{codes.index(2)}.script.log").read_text()
    # exit code 2 alone is no refusal: a script that fails with it, after no usage line, crashed
    crash = expgpu([*CONF, "task=script_probe", "task.args.fail-rank=0", "task.args.fail-code=2"], tmp_path / "crash")
    assert crash.returncode == 1, crash.stderr
    assert "rank 0 failed: its script exited with code 2" in crash.stderr


def test_expgpu_log_outside_expgpu_writes_nothing(tmp_path):
    code = "import expgpu\nfor i in range(3): expgpu.log(loss=1.0, step=i)\nprint('ok')\n"
    for env in ({}, {"RANK": "1", "EXPGPU_SCRIPT_RUN_DIR": str(tmp_path)}):   # plain python; a rank other than 0
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=clean_env(**env), capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and out.stdout == "ok\n" and out.stderr == "", out.stderr
        assert list(tmp_path.iterdir()) == []


def test_gpu_pool_sweep_gives_each_job_its_gpu_and_its_own_dir(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "expgpu", "-m", *CONF, "task=script_probe", "task.args.log=true",
                           "task.args.lr=0.1,0.3", "hydra/launcher=gpu_pool", SIM4, "objective=val_loss",
                           f"hydra.sweep.dir={sweep}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=clean_env(EXPGPU_LEASE_DIR=str(tmp_path / "leases")))
    assert proc.returncode == 0, proc.stderr
    jobs = [started(sweep / str(n)) for n in (0, 1)]
    assert [j["cwd"] for j in jobs] == [str(sweep / "0"), str(sweep / "1")]
    masks = [j["env"]["CUDA_VISIBLE_DEVICES"] for j in jobs]
    assert len(set(masks)) == 2 and all(m in {"0", "1", "2", "3"} for m in masks)   # its leased GPU, only that
    results = [json.loads((sweep / str(n) / "result.json").read_text()) for n in (0, 1)]
    assert [r["metrics"]["val_loss"] for r in results] == pytest.approx([0.01, 0.03])
    assert "best: job 0 (task.args.lr=0.1), val_loss 0.01" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_value_a_sweep_cannot_pass_is_one_line_before_any_job_starts(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "expgpu", "-m", *CONF, "task=script_probe", "task.args.x=[[1]],[[2]]",
                           "hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2", f"hydra.sweep.dir={sweep}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 2, done.stderr
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("expgpu:")]
    assert said == ["expgpu: error: task.args.x=[[1]] is not allowed: a number, string, true/false, null, a list "
                    "of those, or a mapping of them (dotted flags: --trainer.lr=...)"], done.stderr
    assert " started on " not in done.stdout + done.stderr and not (sweep / "0").exists()


def test_under_torchrun_its_variables_pass_through(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    run = expgpu([*CONF, "task=script_probe"], tmp_path / "run",
                 cmd=[str(torchrun), "--nproc-per-node=2", "--master-port=29731", "-m", "expgpu"])
    assert run.returncode == 0, run.stderr
    for rank in (0, 1):
        env = started(tmp_path / "run", rank)["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == (str(rank), "2", "29731")
        assert env["TORCHELASTIC_RUN_ID"] == started(tmp_path / "run", 0)["env"]["TORCHELASTIC_RUN_ID"]
    assert run.result["exit_codes"] == [0, 0] and run.result["source"] == "torchrun"
