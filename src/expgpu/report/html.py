"""report.html: the table and the curves on one page, for a browser (no server, no network).

The best job's row is highlighted, a failed job's row carries its one-line reason, each job links
to its dir; loss_curves.png and optimization.png (beside the page) are shown under the table.
A sweep's page says at the top where it stands (expgpu.report.state) and when it was written. While
the sweep runs the page reloads itself (a meta refresh, no script needed) and a few lines of script
say how old it is, and that it is stale (the sweep's process may be gone) past its staleness limit;
the last page has neither.
"""

from __future__ import annotations

import time
from html import escape
from pathlib import Path

from expgpu.errors import plural
from expgpu.report.best import Ranking, metric_columns, place
from expgpu.report.collect import Row
from expgpu.report.state import Progress
from expgpu.report.table import fmt, headline, rerun

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #ddd; text-align: left; white-space: nowrap; }
th { background: #f3f3f3; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.best td { background: #e6f4e6; font-weight: 600; }
tr.failed td, tr.broken td, tr.missing td { color: #a00; }
td.why { white-space: normal; max-width: 50em; }
.metric { color: #075; }
img { max-width: 100%; border: 1px solid #ddd; }
#sweep-state { padding: 6px 10px; border-left: 4px solid #888; background: #f6f6f6; }
#sweep-state.running { border-color: #27c; } #sweep-state.finished { border-color: #2a2; }
#sweep-state.failed, #sweep-state.stopped, #sweep-state.stale { border-color: #c22; }
tr.running td { color: #27c; } tr.queued td { color: #888; }
"""

# A running page's age, and past data-stale-s its warning: a sweep killed (SIGKILL, a node lost) leaves a
# page that still says "running", and only its age can tell.
_AGE_SCRIPT = """<script>
(function () {
  var p = document.getElementById('sweep-state'), age = document.getElementById('age');
  var s = Date.now() / 1000 - parseFloat(p.dataset.written);
  if (s > parseFloat(p.dataset.staleS)) {
    p.className = 'stale';
    age.textContent = ' STALE: not rewritten for ' + Math.round(s / 60) + ' min, but a running sweep rewrites '
      + 'it at least every ' + Math.round(parseFloat(p.dataset.staleS) / 3) + ' s: its process may be gone.';
  } else {
    age.textContent = ' (' + Math.max(0, Math.round(s)) + ' s ago)';
  }
})();
</script>"""


def _state(p: Progress) -> list[str]:
    """The page's first line: where the sweep stands and when this was written."""
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(p.written))
    jobs = f"{p.done} of {plural(p.total, 'job')} done"
    if p.state != "running":
        return [f"<p id='sweep-state' class='{p.state}' data-written='{p.written:.3f}'>Sweep {p.state}: {jobs}. "
                f"Last written {escape(when)} (final).</p>"]
    busy = ", ".join(x for x in (f"{p.running} running" if p.running else "",
                                 f"{p.queued} queued" if p.queued else "") if x)
    return [f"<p id='sweep-state' class='running' data-written='{p.written:.3f}' data-stale-s='{p.stale_s:.0f}'>"
            f"Sweep running: {jobs}{f' ({busy})' if busy else ''}. Last written {escape(when)}"
            f"<span id='age'></span>. This page reloads every {p.reload_s} s; the curves are drawn when the "
            "sweep ends.</p>", _AGE_SCRIPT]


def page(rows: list[Row], ranking: Ranking, title: str, pngs: list[str], base: Path,
         progress: Progress | None = None) -> str:
    metrics = metric_columns(rows, ranking.metric)
    head = ["rank", "job", "status", *metrics, "steps", "wall s", "devices", "overrides"]
    reload = progress is not None and progress.state == "running"
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>",
           f"<meta http-equiv='refresh' content='{progress.reload_s}'>" if reload else "",
           f"<style>{_STYLE}</style></head><body>", f"<h1>{escape(title)}</h1>",
           *(_state(progress) if progress is not None else []),
           f"<p>{escape(headline(ranking))}</p>"]
    if ranking.common:
        out.append(f"<p>Every job: <code>{escape(' '.join(ranking.common))}</code></p>")
    out.append("<table><tr>" + "".join(
        f"<th class='metric'>{escape(h)}</th>" if h == ranking.metric else f"<th>{escape(h)}</th>" for h in head)
        + "</tr>")
    for r in ranking.rows:
        n = place(r, ranking)
        cls = "best" if r is ranking.best else r.status.replace(" ", "-")
        link = escape(_rel(r.dir, base)) if r.dir is not None else ""
        cells = [f"<td class='num'>{n if n is not None else '-'}</td>",
                 f"<td><a href='{link}'>{escape(r.job)}</a></td>" if link else f"<td>{escape(r.job)}</td>",
                 f"<td>{escape(r.shown_status)}</td>",
                 *(f"<td class='num'>{escape(fmt(r.metrics.get(m), 5))}</td>" for m in metrics),
                 f"<td class='num'>{escape(fmt(r.steps))}</td>",
                 f"<td class='num'>{escape(fmt(None if r.wall_s is None else round(r.wall_s, 1)))}</td>",
                 f"<td>{escape(r.devices or '-')}</td>",
                 f"<td><code>{escape(' '.join(ranking.differs.get(r.job) or []) or '-')}</code></td>"]
        out.append(f"<tr class='{escape(cls)}'>" + "".join(cells) + "</tr>")
        if r.said:
            out.append(f"<tr class='{escape(cls)}'><td></td><td class='why' colspan='{len(head) - 1}'>"
                       f"{escape(r.said)}</td></tr>")
    out.append("</table>")
    if rerun(rows, ranking):
        out.append(f"<p><code>{escape(rerun(rows, ranking))}</code></p>")
    for png in pngs:
        out.append(f"<p><img src='{escape(png)}' alt='{escape(png)}'></p>")
    out.append("</body></html>\n")
    return "\n".join(out)


def _rel(path: Path, base: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(base.resolve())) + "/"
    except ValueError:
        return Path(path).resolve().as_uri()


def write(rows: list[Row], ranking: Ranking, path: Path, title: str, pngs: list[str],
          progress: Progress | None = None) -> None:
    from expgpu.rundir import atomic_write_bytes

    atomic_write_bytes(path, page(rows, ranking, title, pngs, path.parent, progress).encode())
