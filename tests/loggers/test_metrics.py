"""run.log's rows in this process (fast tier): what a metrics.jsonl row keeps of a log_every window
(last or mean), names logged at their own steps, what a checkpoint carries between two flushes, the
trim a resume makes, and values refused in one line."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from expgpu.errors import UserError
from expgpu.loggers.base import Sink
from expgpu.loggers.jsonl import MetricsLog, WindowMeanLog, trim
from expgpu.loggers.progress import FIELDS


def rows(path) -> list[dict]:
    """The rows without their time and progress fields (test_progress.py has those)."""
    return [{k: v for k, v in json.loads(line).items() if k != "time" and k not in FIELDS}
            for line in path.read_text().splitlines()]


def logged(cls, tmp_path, steps: int = 10, log_every: int = 5) -> MetricsLog:
    """x = step + 1 every step (a tensor), ev = 0.5 once at step 3, flushed every log_every steps."""
    m = cls(tmp_path)
    m.open(0, steps)
    for step in range(1, steps + 1):
        m.log(step, {"x": torch.tensor(float(step))})
        if step == 3:
            m.log(step, {"ev": 0.5})
        if step % log_every == 0:
            m.flush(epoch=0)
    m.close(epoch=0)
    return m


def test_a_row_keeps_the_last_value_of_the_window_and_a_name_its_own_step(tmp_path):
    logged(MetricsLog, tmp_path)
    assert rows(tmp_path / "metrics.jsonl") == [{"step": 3, "ev": 0.5, "epoch": 0}, {"step": 5, "x": 5.0, "epoch": 0},
                                                {"step": 10, "x": 10.0, "epoch": 0}]


def test_log_reduce_mean_keeps_the_mean_of_the_window_and_a_single_value_as_logged(tmp_path):
    logged(WindowMeanLog, tmp_path)
    assert rows(tmp_path / "metrics.jsonl") == [{"step": 3, "ev": 0.5, "epoch": 0}, {"step": 5, "x": 3.0, "epoch": 0},
                                                {"step": 10, "x": 8.0, "epoch": 0}]


@pytest.mark.parametrize("saved, resumed", [(MetricsLog, MetricsLog), (WindowMeanLog, WindowMeanLog),
                                            (WindowMeanLog, MetricsLog), (MetricsLog, WindowMeanLog)])
def test_what_was_logged_since_the_last_row_travels_in_the_checkpoint(tmp_path, saved, resumed):
    """Stopped at step 7 of a window of 5: the resumed run writes the row at 10 the uninterrupted one does
    (a checkpoint of one kind read by the other: a resume may change task.log_reduce)."""
    first = saved(tmp_path / "a")
    (tmp_path / "a").mkdir()
    first.open(0, 10)
    for step in range(1, 8):
        first.log(step, {"x": torch.tensor(float(step))})
        if step == 5:
            first.flush(epoch=0)
    state = json.loads(json.dumps(first.state_dict()))   # as the checkpoint stores it
    second = resumed(tmp_path / "a")
    second.load_state_dict(state)
    second.open(7, 10, resumed=True)
    for step in range(8, 11):
        second.log(step, {"x": torch.tensor(float(step))})
    second.close(epoch=0)
    # the mean of 6..10 as the uninterrupted run has it; a last value (7) carried into a mean counts once
    expected = 10.0 if resumed is MetricsLog else (8.0 if saved is WindowMeanLog else 8.5)
    assert rows(tmp_path / "a" / "metrics.jsonl")[-1] == {"step": 10, "x": expected, "epoch": 0}


def test_a_resume_trims_the_rows_after_its_checkpoint_and_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (10, 20, 30)) + '{"step": 4')
    assert trim(path, 20) == 30
    assert [r["step"] for r in rows(path)] == [10, 20]
    assert trim(tmp_path / "none.jsonl", 5) == -1


@pytest.mark.parametrize("value, needle", [
    (torch.ones(3), "run.log(x=...): a tensor of shape (3,); log numbers or one-element tensors"),
    ("high", "run.log(x=...): a str; log numbers or one-element tensors"),
])
def test_a_value_that_is_no_number_is_one_line_at_the_flush(tmp_path, value, needle):
    m = MetricsLog(tmp_path)
    m.log(1, {"x": value})
    with pytest.raises(UserError) as caught:
        m.flush(epoch=0)
    assert needle in str(caught.value)


def test_numbers_of_every_kind_are_written_as_json_numbers(tmp_path):
    import numpy as np

    m = MetricsLog(tmp_path)
    m.log(1, {"i": 3, "f": 0.25, "b": True, "np": np.float32(1.5), "t": torch.tensor(2, dtype=torch.int64),
              "nan": float("nan")})
    m.close(epoch=2)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: row[k] for k in ("i", "f", "b", "np", "t", "epoch")} == {"i": 3, "f": 0.25, "b": 1, "np": 1.5, "t": 2,
                                                                       "epoch": 2}
    assert row["nan"] != row["nan"]


class _SlowSink(Sink):
    """A sink whose every call takes a while, as a tracking store's does; it records the calls and
    whether two ever overlapped."""

    def __init__(self):
        self.calls: list[str] = []
        self.inside = 0
        self.overlapped = False
        self.entered = threading.Event()   # a call has begun

    def _call(self, what: str) -> None:
        self.entered.set()
        self.inside += 1
        self.overlapped |= self.inside > 1
        time.sleep(0.2)
        self.calls.append(what)
        self.inside -= 1

    def write(self, rows):
        self._call("write")

    def finish(self, status, metrics, step, last_row):
        self._call(status)


def test_the_loggers_runs_end_once_when_two_threads_end_them_while_rows_are_sent(tmp_path):
    # The main thread's exception path and the hang watchdog's thread (a peer failed) may both end the
    # runs while rows are still being sent, and the watchdog's then ends the process: one call at a time,
    # the second end waits for the first and adds nothing (an MLflow run would otherwise stay RUNNING).
    sink = _SlowSink()
    m = MetricsLog(tmp_path, sinks=[sink], show=False)
    m.open(0, 10)
    m.log(1, {"x": 1.0})
    threads = [threading.Thread(target=m.flush, args=(0,))]
    threads[0].start()
    assert sink.entered.wait(10)   # the rows are being sent: the two ends come while they are
    threads += [threading.Thread(target=m.finish_loggers, args=("failed", {}, 1)) for _ in range(2)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sink.calls == ["write", "failed"] and not sink.overlapped
    m.log(2, {"x": 2.0})
    m.close(epoch=0)   # a row after the end: metrics.jsonl has it, the ended runs do not
    assert sink.calls == ["write", "failed"] and [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [1, 2]
