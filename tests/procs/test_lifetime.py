"""procs.fast_exit: the user's atexit work runs, torch's own exit-time tidying of its dispatcher does not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_fast_exit_runs_the_users_finalizers_but_not_torchs_library_deregistration(tmp_path):
    code = textwrap.dedent(f"""
        import atexit, tempfile, weakref
        import torch, torch._dynamo, torch.library
        from expgpu.procs import fast_exit

        calls = []
        real = torch.library._del_library
        for f in list(weakref.finalize._registry):   # count the library finalizers that would run
            info = f.peek()
            if info is not None and info[1] is real:
                calls.append(f)
        assert len(calls) > 100, len(calls)
        kept = tempfile.mkdtemp(dir={str(tmp_path)!r})

        class Thing:
            pass

        thing = Thing()
        weakref.finalize(thing, lambda: open({str(tmp_path / 'finalized')!r}, 'w').close())
        gone = tempfile.TemporaryDirectory(dir={str(tmp_path)!r})
        print(kept, gone.name, flush=True)
        atexit.register(lambda: print("skipped:", sum(not f.atexit for f in calls), "of", len(calls), flush=True))
        fast_exit(7)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 7, out.stderr
    kept, gone, _, skipped, _, of = out.stdout.split()
    assert skipped == of                              # every library finalizer was left out
    assert (tmp_path / "finalized").exists()          # the user's weakref.finalize ran at exit
    assert not Path(gone).exists() and Path(kept).is_dir()   # TemporaryDirectory's cleanup too
