"""A task's parameters checked before any job starts, where a refusal would otherwise come late: a
dry run (dry_run=true says whether the run would start), and the launchers that submit jobs to a queue
(hydra/launcher=slurm and submitit_local, slurm_pool, expgpu_optuna's trials on them), so that
`-m task.lrr=1e-3,1e-2` is one line with nothing submitted, not every job failing after its wait in the queue.

The check is the job's own, before it builds anything (expgpu.task.resolve: the function imported, every key one
of its parameters, every value of its annotated type; check_targets: each `{_target_: ...}` entry's callable
imported, every key of the entry one it takes: `task.model.hiden`). Where it is made:
- in a child process: it imports a task function's module, the built-in loop's model and optimizer classes,
  which import torch and may touch CUDA, and neither belongs in a launcher or a dry run. The child sees the
  launcher's sys.path (the launch dir's modules) and no GPU (CUDA_VISIBLE_DEVICES empty: a dry run uses none);
- in a process that has torch already (a gpu_pool job's dry run, on its own GPU), in that process:
  its run would import the module there too, and a child would pay torch's import again.
What cannot be settled before the job refuses nothing: a module that raises on import (a dependency missing
here, a library that needs the node's GPU driver), or the child failing or timing out, is a warning; the job
checks again at its start.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Sequence

from expgpu.errors import UserError, first_line

log = logging.getLogger("expgpu")

TIMEOUT_S = 120   # the import of torch and of the task's module: seconds


def check(jobs: Sequence[tuple[str, dict]], then: str = "") -> None:
    """Each (label, task config) checked as its job will check it; the first one refused raises its UserError,
    the job's label and `then` (what was not done) behind the key it names. Function tasks and the built-in
    loop (a script task is expgpu.script.spec's to check). Each distinct task config is checked once, all in
    one child."""
    if not jobs:
        return
    distinct = {_key(task): task for _, task in jobs}
    if "torch" in sys.modules:   # where it is checked: the module's docstring
        verdicts = {k: verdict(t) for k, t in distinct.items()}
    else:
        verdicts = dict(zip(distinct, _in_child(list(distinct.values()))))
    warned = set()
    for label, task in jobs:
        said = verdicts[_key(task)]
        if said is None:
            continue
        where = "; ".join(w for w in (label, then) if w)
        if not said["soft"]:
            raise UserError(said["error"] + (f"; {where}" if where else ""))
        if said["error"] not in warned:
            warned.add(said["error"])
            log.warning("not checked before the start: %s; the job checks its task again where it runs",
                        said["error"])


def _key(task: dict) -> str:
    return json.dumps(task, sort_keys=True, default=str)


def _in_child(tasks: list[dict]) -> list[dict | None]:
    """[None (accepted) or {"error": its line, "soft": whether it may pass where the job runs}] for each task."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    payload = json.dumps({"path": list(sys.path), "tasks": tasks}, default=str)
    try:
        proc = subprocess.run([sys.executable, "-m", "expgpu.task.precheck"], input=payload, capture_output=True,
                              text=True, timeout=TIMEOUT_S, env=env)
        if proc.returncode != 0:
            raise ValueError(f"its check exited {proc.returncode}: "
                             f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        out = json.loads((proc.stdout.strip().splitlines() or ["null"])[-1])
        if not isinstance(out, list) or len(out) != len(tasks):
            raise ValueError("its check printed no verdict (does the task's module print to stdout when imported?)")
        return out
    except subprocess.TimeoutExpired:
        soft = f"task: importing the task's module took over {TIMEOUT_S} s"
    except (ValueError, OSError) as e:
        soft = f"task: {first_line(e)}"
    return [{"error": soft, "soft": True}] * len(tasks)


def verdict(task: dict) -> dict | None:
    """In this process (imports the task's module): None when the job would accept `task`."""
    from expgpu.task import ImportRaised, check_targets, resolve

    try:
        check_targets(resolve(task))
    except ImportRaised as e:   # it may import where its job runs
        return {"error": str(e), "soft": True}
    except UserError as e:
        return {"error": str(e), "soft": False}
    except Exception as e:   # resolve's own trouble (a type hint that cannot be read): the job's to say
        return {"error": f"task: {type(e).__name__}: {first_line(e)}", "soft": True}
    return None


def main() -> None:   # the child: {"path", "tasks"} on stdin, their verdicts as JSON on stdout's last line
    payload = json.loads(sys.stdin.read())
    sys.path[:0] = [p for p in payload["path"] if p not in sys.path]
    verdicts = [verdict(task) for task in payload["tasks"]]
    print("\n" + json.dumps(verdicts), flush=True)


if __name__ == "__main__":
    main()
