"""`expgpu status [DIR]` (or `python -m expgpu.status`): where the runs and sweeps under DIR (default outputs/) are.

    expgpu status                       every run and sweep under outputs/, newest first
    expgpu status outputs/multirun/2025-01-31/12-00-00    a sweep's jobs, one row each
    expgpu status --watch 5             the same, refreshed every 5 s until Ctrl-C
    expgpu status --json                a list of rows, for scripts

One row a run: its status (running, finished, failed, stopped, pruned, diverged, hung, lost: its process died without a
result; queued: a SLURM job not started), step of total, the last logged values, GPUs, elapsed, ETA, its dir; a
sweep as one row with its jobs' counts. It reads only the run dirs (and asks squeue, once, about SLURM jobs whose
files cannot say), never imports torch, and answers in well under a second for a thousand run dirs.

Modules: read (one run dir: result.json, the tail of metrics.jsonl, the process record), sweeps (what is under a
dir, a sweep's jobs), queue (squeue), table (the text), cli (the command line); busy (a run dir another run
is using). The names below load their module on first use: every run's start imports expgpu.status.busy, and
so this package, which would otherwise cost it the reader and the report (~17 ms).
"""

from __future__ import annotations

from expgpu import lazy

_WHERE = {"RunRow": "read", "read_run": "read", "find": "sweeps", "rows": "sweeps", "table": "table", "main": "cli"}
__all__ = sorted(_WHERE)
__getattr__ = lazy.names("expgpu.status", _WHERE)
