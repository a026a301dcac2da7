"""The fork servers' warm imports (procs.forkserver.warm_imports): what they import must leave a fork
that works as a fresh process would."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def test_a_module_that_runs_a_torch_op_at_import_leaves_forks_that_run_on_several_threads():
    # torch's OpenMP pool, started in a parent by an op at import, hangs a fork's first parallel op
    code = textwrap.dedent(f"""
        import os, sys
        from expgpu.procs.forkserver import warm_imports
        import torch
        before = torch.get_num_threads()
        warm_imports(["torch", "op_at_import"], [{str(HELPERS)!r}])
        assert torch.get_num_threads() == before, (torch.get_num_threads(), before)
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(2)   # a job's thread budget, as the pool gives it after the fork
            total = (torch.ones(4000, 64) / 3.0).sum().item()
            os._exit(0 if total > 0 else 1)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "child exit 0"
