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
from expgpu.loggers.nonfinite import NonFinite
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


def _steps(path) -> list[int]:
    return [r["step"] for r in rows(path)] if path.exists() else []


class _Recording(Sink):
    """A sink that keeps the steps of the rows it is sent, per call."""

    def __init__(self, prompt=()):
        self.prompt = frozenset(prompt)
        self.calls: list[list[int]] = []

    def write(self, rows):
        self.calls.append([r["step"] for r in rows])


def test_rows_are_written_together_at_most_once_a_second_and_at_every_write_out(tmp_path):
    # Putting a row into words and writing it at every flush (every log_every steps) cost a fast loop
    # 2-3 % of its steps/s: the first row is written at once (the run is seen to start), later ones
    # at most every WRITE_EVERY_S, and every checkpoint's write_out and the end write them all, in order.
    sink = _Recording()
    m = MetricsLog(tmp_path, sinks=[sink], show=False)
    m.open(0, 100)
    path = tmp_path / "metrics.jsonl"
    for step in range(1, 5):
        m.log(step, {"x": float(step)})
        m.flush(epoch=0)
    assert _steps(path) == [1] and sink.calls == [[1]]
    m.write_out()   # a checkpoint's: its rows are on disk before it
    assert _steps(path) == [1, 2, 3, 4] and sink.calls == [[1], [2, 3, 4]]
    m.log(5, {"x": 5.0})
    m.written_at -= 1.0   # a second has passed since the last write-out
    m.flush(epoch=0)
    assert _steps(path) == [1, 2, 3, 4, 5]
    m.log(6, {"x": 6.0})
    m.flush(epoch=1)
    m.close(epoch=1)
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["x"], r["epoch"]) for r in got] == [(s, float(s), 0 if s < 6 else 1) for s in range(1, 7)]
    assert all(r["max_steps"] == 100 for r in got) and "steps_per_s" in got[-1]
    assert [r["time"] for r in got] == sorted(r["time"] for r in got)   # each row's time is its flush's
    assert sink.calls == [[1], [2, 3, 4], [5], [6]] and m.last_row["step"] == 6


def test_a_row_a_sink_wants_at_once_is_written_at_its_flush(tmp_path):
    # A pruner's objective: the trial may end on it, so its row does not wait for the write-out.
    trial, other = _Recording(prompt={"acc"}), _Recording()
    m = MetricsLog(tmp_path, sinks=[trial, other], show=False)
    m.open(0, 100)
    for step in (1, 2, 3):
        m.log(step, {"loss": 1.0 / step})
        m.flush(epoch=0)
    m.log(4, {"acc": 0.5})
    m.flush(epoch=0)
    assert trial.calls == other.calls == [[1], [2, 3, 4]]
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]


def test_after_a_crash_the_sinks_get_the_rows_before_it_and_not_the_crash_steps(tmp_path):
    sink = _Recording()
    m = MetricsLog(tmp_path, sinks=[sink], show=False)
    m.open(0, 100)
    for step in (1, 2):
        m.log(step, {"x": float(step)})
        m.flush(epoch=0)
    m.log(3, {"x": 3.0})   # then the step crashed
    m.close(epoch=0, crashed=True)
    assert sink.calls == [[1], [2]] and _steps(tmp_path / "metrics.jsonl") == [1, 2, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [MetricsLog, WindowMeanLog])
def test_a_gpu_value_is_copied_at_the_flush_without_waiting_and_read_when_written(tmp_path, cls):
    # A plain loop's loss.item() waits for the GPU at every print; the flush only queues the copy.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    def value(step):
        return torch.full((), float(step), device="cuda", dtype=torch.bfloat16)

    m = cls(tmp_path, show=False)
    m.open(0, 10)
    for step in (1, 2):
        m.log(step, {"x": value(step)})
    # the first row, written at once: every kernel below loaded and the host memory of the copy made, which the
    # first time may wait for the GPU (a module's lazy load), as a real run's first flush does and no later one
    m.flush(epoch=0)
    torch.cuda._sleep(2_000_000_000)   # about a second of GPU work queued before the next values
    for step in (3, 4):
        m.log(step, {"x": value(step)})
    t0 = time.monotonic()
    m.flush(epoch=0)
    assert time.monotonic() - t0 < 0.3
    assert not torch.cuda.current_stream().query(), "the queued GPU work ended already: nothing left to wait for"
    m.write_out(wait=False)   # the watchdog's thread: the row whose value has not arrived waits
    assert _steps(tmp_path / "metrics.jsonl") == [2]
    m.close(epoch=0)
    mean = cls is WindowMeanLog
    assert rows(tmp_path / "metrics.jsonl") == [{"step": 2, "x": 1.5 if mean else 2.0, "epoch": 0},
                                                {"step": 4, "x": 3.5 if mean else 4.0, "epoch": 0}]


@pytest.mark.gpu
def test_after_a_crash_the_last_rows_wait_a_moment_for_their_gpu_values(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = MetricsLog(tmp_path, show=False)
    m.open(0, 10)
    m.log(1, {"x": torch.ones((), device="cuda")})
    m.flush(epoch=0)
    torch.cuda._sleep(1_000_000_000)   # about half a second of GPU work still queued at the crash
    m.log(2, {"x": torch.full((), 2.0, device="cuda")})
    m.flush(epoch=0)
    m.log(3, {"x": torch.full((), 3.0, device="cuda")})   # the crash step's
    m.close(epoch=0, crashed=True)
    assert [(r["step"], r["x"]) for r in rows(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_a_loss_or_score_that_becomes_nan_or_inf_is_said_once_at_its_first_row(tmp_path, caplog):
    # what an fp16 loss scaler makes routine (an inf grad_norm) and names of no known kind are left alone
    m = MetricsLog(tmp_path)
    m.open(0, 12)
    with caplog.at_level("WARNING", logger="expgpu"):
        for step in range(1, 13):
            m.log(step, {"loss": torch.tensor(float("nan") if step >= 6 else 1.0 / step),
                         "grad_norm": float("inf") if step == 4 else 1.0, "lr": float("nan")})
            if step == 8:
                m.log(step, {"val/acc": float("-inf")})
            if step % 4 == 0:
                m.flush(epoch=0)
        m.close(epoch=0)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert m.nonfinite.first == {"loss": 8, "val/acc": 8}, said
    assert len(said) == 2 and said[0].startswith("loss is nan at step 8, the first logged value of it that is not "
                                                 "a finite number; the run goes on to its end (task.on_nonfinite=stop "
                                                 "ends it there"), said
    assert said[1].startswith("val/acc is -inf at step 8"), said


def test_under_on_nonfinite_stop_the_first_nan_loss_asks_once_for_the_stop(tmp_path, caplog):
    asked = []
    m = MetricsLog(tmp_path, nonfinite=NonFinite(stop=lambda: asked.append(True)))
    m.open(0, 12)
    with caplog.at_level("WARNING", logger="expgpu"):
        for step in range(1, 13):
            m.log(step, {"loss": float("nan") if step >= 6 else 1.0, "grad_norm": float("inf")})
            if step == 10:
                m.log(step, {"eval_loss": float("nan")})
            if step % 2 == 0:
                m.flush(epoch=0)
        m.close(epoch=0)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert asked == [True] and m.nonfinite.first == {"loss": 6, "eval_loss": 10}, (asked, said)
    assert len(said) == 1 and said[0].startswith("loss is nan at step 6, the first logged value of it that is not a "
                                                 "finite number; stopping every rank (task.on_nonfinite=stop)"), said
