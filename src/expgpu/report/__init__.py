"""`expgpu-report SWEEP_DIR` (or `python -m expgpu.report`): which job of a sweep was best, and why
the others failed.

    expgpu-report outputs/multirun/2025-01-31/12-00-00
    expgpu-report outputs/multirun/2025-01-31/12-00-00 --metric eval_accuracy --maximize

One row per job, best first (report.rank says by what), the overrides that tell jobs apart, a
column per metric the jobs returned, a failed job's one-line reason. Writes, into SWEEP_DIR only:
report.csv (one column per override key), loss_curves.png (a panel per metric the jobs logged,
the ranking metric first; matplotlib's Agg backend: no display needed), for a sweep of
hydra/sweeper=expgpu_optuna optimization.png (report.history), and report.html (all on one page).
A sweep writes the same at its end (report.callback), and report.csv and report.html from its start and
as its jobs end (report.live: the page reloads itself while the sweep runs). Never writes into a job dir.

Modules: collect (a sweep's job dirs, read), best (the ranking), table, plot, history and html (what is
written), files (the file names and write()), live and state (the page while the sweep runs), callback (the
Hydra callback), command (the command line).
"""

from __future__ import annotations

from expgpu import lazy
from expgpu.report.files import CSV_FILE, HTML_FILE, PNG_FILE

# The names below load their module on first use: every run's start instantiates the sweep report's
# Hydra callback (expgpu.report.callback), which imports this package, and a run needs none of them (~10 ms).
# (Not `collect`, the function: the package's attribute of that name is its module once imported.)
_WHERE = {"Progress": "state", "Ranking": "best", "rank": "best", "Row": "collect", "read_job": "collect",
          "write": "files", "main": "command", "cli": "command"}
__all__ = ["CSV_FILE", "HTML_FILE", "PNG_FILE", "Progress", "Ranking", "Row", "cli", "main", "rank",
           "read_job", "write"]
__getattr__ = lazy.names("expgpu.report", _WHERE)
