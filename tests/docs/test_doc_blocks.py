"""Every shell block the docs mark `<!-- cpu -->` runs, for real, on this CPU: in a temp dir (its
outputs/ there; examples/, scripts/ and bench/ linked in, as the commands name them relative to a
checkout), each `python -m expgpu` run of a function task cut to TASK_STEPS steps unless the block sets
task.max_steps itself, and simulated GPUs where the block names them (`inventory.simulate`). A block
fails with its page and line and the end of its output."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from doc_blocks import REPO, Block, blocks, checked, commands, expgpu_commands, pages, samples, shell_text

from conftest import clean_env

sys.path.insert(0, str(REPO / "examples"))   # the examples' tasks, to see whether they take max_steps
TASK_STEPS = 20
LINKED = ("examples", "scripts", "bench")    # what the blocks name by a path relative to the checkout


def marked() -> list[Block]:
    return [b for page in pages() for b in blocks(page) if b.cpu]


def shortened(block: Block, where: Path) -> str:
    """The block's shell text with `task.max_steps=TASK_STEPS` after each expgpu command that trains a
    function task taking max_steps and does not set it (not a dry run, not a script task)."""
    from expgpu import task

    text = shell_text(block)
    ends = {c.end: c for c in commands(text)}
    cuts = []
    for cmd in expgpu_commands(block):
        given = {o.split("=", 1)[0].lstrip("+") for o in cmd.overrides}
        if "task.max_steps" in given or "dry_run=true" in cmd.overrides:
            continue
        config_dir = where / cmd.config_dir if cmd.config_dir else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = checked(samples(cmd.overrides)[0], config_dir)
        if "script" in plain["task"] or "module" in plain["task"]:
            continue
        if "max_steps" in inspect.signature(task.resolve(plain["task"]).fn).parameters:
            cuts.append(cmd.simple.end)
    assert all(end in ends for end in cuts)
    for end in sorted(cuts, reverse=True):
        text = text[:end] + f" task.max_steps={TASK_STEPS}" + text[end:]
    return text


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", marked(), ids=lambda b: b.where())
def test_a_block_marked_cpu_runs(block, tmp_path):
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    script = shortened(block, tmp_path)
    env = clean_env(PYTHONPATH=str(REPO / "src"))   # this checkout's src first
    # `python` and the console scripts (expgpu-report, expgpu) are this environment's
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    # Its own session: whatever the block leaves running in the background is ended with it.
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.where()}: the block did not end within 540 s:\n{script}\n...{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{block.where()}: the block exited {proc.returncode}:\n{script}\n...{out[-3000:]}"


def test_the_docs_mark_blocks_to_run_and_cut_them_short(tmp_path):
    # Fast: which blocks run, and that a long run is cut short while a dry run or a script task is not.
    assert len(marked()) >= 10
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    block = Block(REPO / "x.md", 1, "bash", "python -m expgpu task=b launch.nproc_per_node=2   # two ranks\n"
                  "python -m expgpu dry_run=true && python -m expgpu task=a task.max_steps=5\n"
                  "python -m expgpu --config-dir examples/conf task=ddp_script\n", True)
    assert shortened(block, tmp_path).splitlines() == [
        f"python -m expgpu task=b launch.nproc_per_node=2 task.max_steps={TASK_STEPS}   # two ranks",
        "python -m expgpu dry_run=true && python -m expgpu task=a task.max_steps=5",
        "python -m expgpu --config-dir examples/conf task=ddp_script"]
