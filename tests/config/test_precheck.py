"""expgpu.task.precheck: a task's parameters checked before its jobs start (a dry run, a launcher that submits to
a queue), as the job would check them. Each case runs in a fresh process, as a launcher does: a task function's
module, or the classes its `_target_` entries name, are imported in a real child process there (torch not
imported yet), or in that process itself where torch is (a gpu_pool job's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

BUILT_IN = {"model": {"_target_": "torch.nn.Linear"}, "dataset": {}, "optimizer": {}, "batch_size": 4,
            "max_steps": 3}
TRAIN = """
    def train(run, lr: float = 1e-3, steps: int = 10):
        return {"loss": 0.0}
    """
CHECK = """
    import json, logging, sys
    if sys.argv[3] == "warm":
        import torch
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    from expgpu.errors import UserError
    from expgpu.task import precheck
    try:
        precheck.check([tuple(job) for job in json.loads(sys.argv[1])], then=sys.argv[2])
    except UserError as e:
        print(f"refused: {e}")
    print(f"torch imported: {'torch' in sys.modules}")
    """


def check(where: Path, jobs: list[tuple[str, dict]], then: str = "", warm: bool = False) -> list[str]:
    """precheck.check(jobs) in a fresh process started in `where` (its modules importable, as from a launch
    dir): what it said, a line each (`refused: ...`, `warning: ...`, `torch imported: ...`)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}   # the launcher's GPUs, unmasked
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK), json.dumps(jobs), then,
                           "warm" if warm else "cold"], cwd=where, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return (done.stdout + done.stderr).strip().splitlines()


def module(where: Path, name: str, source: str) -> str:
    (where / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def test_the_built_in_loops_misspelt_key_names_the_job_and_what_was_not_done(tmp_path):
    jobs = [("job #0 (task.lr=1)", BUILT_IN), ("job #1 (task.lr=2)", {**BUILT_IN, "lrr": 2})]
    said = check(tmp_path, jobs, then="nothing was submitted")
    assert said[0].startswith("refused: task.lrr: expgpu.tasks.supervised.train takes no parameter 'lrr'"), said
    assert said[0].endswith("; job #1 (task.lr=2); nothing was submitted"), said
    # the good one alone passes; its model class (torch's) was imported in a child, not in the launcher
    assert check(tmp_path, jobs[:1]) == ["torch imported: False"]


def test_a_target_entrys_key_its_class_does_not_take_is_refused_before_anything_is_built(tmp_path):
    said = check(tmp_path, [("", {**BUILT_IN, "model": {"_target_": "torch.nn.Linear", "in_feature": 4}})])
    assert said[0].startswith("refused: task.model.in_feature: torch.nn.Linear takes no parameter 'in_feature' "
                              "(did you mean task.model.in_features?)"), said
    said = check(tmp_path, [("", {**BUILT_IN, "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True,
                                                              "momentum": 0.9}})])
    assert said[0].startswith("refused: task.optimizer.momentum: torch.optim.Adam takes no parameter 'momentum'")
    said = check(tmp_path, [("", {**BUILT_IN, "model": {"_target_": "torch.nn.Nope"}})])
    assert said[0] == "refused: task.model._target_=torch.nn.Nope: torch.nn has no attribute 'Nope'", said


def test_a_task_functions_keys_and_values_are_checked_against_its_signature_in_a_child(tmp_path):
    fn = {"_target_": f"{module(tmp_path, 'checked_tasks', TRAIN)}.train", "_partial_": True}
    cases = [{**fn, "lr": 0.1, "steps": 3}, {**fn, "lrr": 0.1}, {**fn, "steps": "many"},
             {**fn, "_target_": "checked_tasks.trian"}, {**fn, "_target_": "no_such_tasks.train"}]
    said = [check(tmp_path, [("", task)]) for task in cases]
    assert said[0] == ["torch imported: False"], said[0]   # the module was imported in a child, not here
    assert said[1][0].startswith("refused: task.lrr: checked_tasks.train takes no parameter 'lrr' (did you mean "
                                 "task.lr?); it takes lr, steps"), said[1]
    assert said[2][0].startswith("refused: task.steps='many' is not allowed: an integer"), said[2]
    assert said[3][0] == "refused: task._target_=checked_tasks.trian: checked_tasks has no attribute 'trian'"
    assert said[4][0].startswith("refused: task._target_=no_such_tasks.train: no module named 'no_such_tasks'")


def test_a_module_with_a_syntax_error_is_refused(tmp_path):
    said = check(tmp_path, [("", {"_target_": f"{module(tmp_path, 'broken_tasks', 'def train(run:')}.train"})])
    assert said[0].startswith("refused: task._target_=broken_tasks.train: importing broken_tasks.train failed: "
                              "SyntaxError"), said


NEEDS_GPU = """
    import os
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        raise RuntimeError("this module needs a GPU")
    def train(run):
        pass
    """


def test_the_child_sees_no_gpu_and_what_it_cannot_settle_is_a_warning_not_a_refusal(tmp_path):
    # a module that needs its job's GPU at import raises in the child (which sees none), and one whose dependency
    # is not here may find it where its job runs (the job's `module load`, a library needing the GPU driver)
    gpu = module(tmp_path, "needs_gpu_tasks", NEEDS_GPU)
    missing = module(tmp_path, "missing_dep_tasks", "import no_such_dependency_xyz\ndef train(run): pass\n")
    said = check(tmp_path, [("", {"_target_": f"{gpu}.train"}), ("", {"_target_": f"{gpu}.train", "seed": 1}),
                            ("", {"_target_": f"{missing}.train"})])
    warned = [line for line in said if line.startswith("warning: ")]
    assert len(warned) == 2 and not any(line.startswith("refused") for line in said), said   # once per module
    assert "not checked before the start" in warned[0] and "RuntimeError: this module needs a GPU" in warned[0]
    assert "ModuleNotFoundError: No module named 'no_such_dependency_xyz'" in warned[1], said


def test_in_a_process_with_torch_already_the_task_is_checked_there(tmp_path):
    # a gpu_pool job's dry run: torch is warm in its process, which owns its GPU; no child paying torch's import
    gpu = module(tmp_path, "needs_gpu_tasks", NEEDS_GPU)
    assert check(tmp_path, [("", {"_target_": f"{gpu}.train"})], warm=True) == ["torch imported: True"]
    fn = f"{module(tmp_path, 'checked_tasks', TRAIN)}.train"
    said = check(tmp_path, [("", {"_target_": fn, "lrr": 1})], warm=True)
    assert said[0].startswith("refused: task.lrr: checked_tasks.train takes no parameter 'lrr'"), said


def test_a_child_that_dies_or_prints_no_verdict_refuses_nothing(tmp_path):
    dies = module(tmp_path, "dying_tasks", "import os\nos._exit(3)\n")
    quits = module(tmp_path, "quitting_tasks", "import sys\nsys.exit(0)\n")
    said = [*check(tmp_path, [("", {"_target_": f"{dies}.train"})]),
            *check(tmp_path, [("", {"_target_": f"{quits}.train"})])]
    warned = [line for line in said if line.startswith("warning: ")]
    assert "exited 3" in warned[0] and "printed no verdict" in warned[1], said


def test_a_module_that_prints_when_imported_still_gets_its_verdict(tmp_path):
    chatty = module(tmp_path, "chatty_tasks", "print('hello', end='')\n" + textwrap.dedent(TRAIN))
    assert check(tmp_path, [("", {"_target_": f"{chatty}.train", "lr": 0.5})]) == ["torch imported: False"]
    said = check(tmp_path, [("", {"_target_": f"{chatty}.train", "lrr": 0.5})])
    assert said[0].startswith("refused: task.lrr: chatty_tasks.train takes no parameter 'lrr'"), said
