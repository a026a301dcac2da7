"""The half of expgpu.train.run.Run that expgpu's own machinery uses, not the training function: where the
rank is, read by the hang watchdog from a thread of its own (expgpu.train.watchdog), and the end of the run
for whoever called the task function (expgpu.launch.worker): the last rows and checkpoint, the loggers' runs,
this rank's part of result.json. A mixin of Run: it reads the state Run keeps."""

from __future__ import annotations

import time

from expgpu.distributed import group
from expgpu.loggers.progress import DATA_WARN
from expgpu.procs.hang_rules import ENDED, ENDED_IN_STEP, SETUP
from expgpu.procs.stop_signals import FINAL_REQUESTS, PRUNED

# A rank that waited for its batches DATA_WARN of its training time or more, in a training of at least
# DATA_WARN_S (a short one's first batch, its loader's workers starting, is most of it), is said at the end.
DATA_WARN_S = 20.0


class RunEnd:
    @property
    def pruned(self) -> bool:
        """An optimizing sweeper's pruner ended the run (expgpu.tune)."""
        return self.stop_signal == PRUNED

    @property
    def final_stop(self) -> bool:
        """The run stopped on a request of its own that ends it for good: a prune, or a loss that became nan under
        task.on_nonfinite=stop. Nothing is kept to resume it (no checkpoint: a large model's save would hold the
        GPU and the pool's slot for nothing). A signal that lands beside one wins the ranks' agreement: that stop
        is resumable, and saves."""
        return self.stop_signal in FINAL_REQUESTS

    def progress(self) -> tuple[int, str]:
        """(steps done, what the rank does now: setup until its run.steps / run.epochs begins; "first
        step" until this process has finished one (it may compile); train inside run.steps; "outside
        the steps" in its own code between epochs or after the loop (an evaluation not in a run.phase);
        checkpoint, or a run.phase name; once its last loop is over, why (its data ran out, its max_steps
        done); ended once the task function has returned); read by the hang watchdog from a thread of its own."""
        if self._ended:   # its peers may still be inside a step this rank will never make
            why = self._steps_over if self._ended == ENDED else ""   # after its last loop: why that loop ended
            return self.step, f"{ENDED}: {why}" if why else self._ended
        if self._steps_over:   # its end-of-training save, its own code after the loop: a slow phase, and no step
            return self.step, self._steps_over   # follows (a peer that went on waits for it)
        phase = self._phase
        if phase == "train":
            if not self._started:
                phase = SETUP
            elif not self._in_steps:
                phase = "outside the steps"
            elif self.step == self._start_step:
                phase = "first step"
        return self.step, phase

    def write_out_rows(self) -> None:
        """The metrics.jsonl rows made so far, handed to the OS (before a peer's failure ends this rank, from
        the watchdog's thread: the rows whose values the GPU has delivered)."""
        if self._metrics is not None:
            self._metrics.write_out(wait=False)

    def close(self, finished: bool) -> None:
        """After the function: the last rows, and a checkpoint if the loop ended early (a break)."""
        try:
            if finished:
                self._ended = ENDED_IN_STEP if self._in_step else ENDED
                self._count_broken_step()
            if finished and self._started and self._saved_at != self.step:
                self._agreement.settle()
                group.sync_device(self.device)
                self._timing["end"] = self._timing["end"] or time.time()
                self._save("end of training")
        finally:
            if finished:
                self._state.settle()   # an async_save still being written: in place before the run ends
            if self._metrics is not None:
                # after a stop, what was logged since the last row is in the checkpoint (written on resume);
                # a pruned or diverged run has none: its last row is written now, as at an end
                in_checkpoint = self._stopped and not self.final_stop
                self._metrics.close(self.epoch, flush=not in_checkpoint, crashed=not finished and not self._stopped)

    def finish_loggers(self, status: str, metrics: dict) -> None:
        """rank 0: the loggers' runs end (finished, stopped: resumable, failed) with the returned metrics."""
        if self._metrics is not None:
            self._metrics.finish_loggers(status, metrics, self.step)

    def timings(self, t_start: float) -> dict:
        """startup_s (from `t_start` to the first step), first_step_at, train_s, steps_per_s, and data_wait: the
        share of train_s that run.steps waited for batches (None without a loader)."""
        first, t10, end = self._timing["first_step_at"], self._timing["t10"], self._timing["end"]
        timed = self.step - self._start_step - 10
        train_s = end - first if first and end else None
        return {"startup_s": round(first - t_start, 3) if first else None, "first_step_at": first,
                "train_s": round(train_s, 3) if train_s is not None else None,
                "steps_per_s": round(timed / (end - t10), 2) if t10 and end and timed > 0 else None,
                "data_wait": round(min(1.0, self._waited / train_s), 3) if train_s and self._waited is not None
                else None}

    def data_workers(self) -> tuple[int | None, bool]:
        """The worker processes of the last loader run.steps took batches from (None: not a DataLoader), and
        whether they live as long as it (persistent_workers)."""
        return self._loader_workers

    def checksums(self) -> tuple[str | None, str | None]:
        """Hashes of the tracked modules' state and of their parameters alone: equal on every rank of a
        data-parallel run that stayed in step (expgpu.checkpoint.state)."""
        return self._state.checksums()

    def result(self, t_start: float, step_means: str) -> dict:
        """This rank's part of result.json, once closed (expgpu.results has the whole schema)."""
        extra = dict(self.result_extra)
        if self._metrics is not None and self._metrics.nonfinite.first:   # rank 0: a loss that became nan
            extra.setdefault("nonfinite", dict(self._metrics.nonfinite.first))
        whole, weights = self.checksums()
        return {"weights_checksum": weights,   # for the ranks' comparison (expgpu.launch.worker), not result.json
                "steps": self.step, "max_steps": self.max_steps, "epochs": self._epochs,
                "length_keys": self.length_keys, "step_means": extra.pop("step_means", step_means),
                "resumed_from_step": self.resumed_from_step, "stop_signal": self.stop_signal,
                "timing": self.timings(t_start), "param_checksum": whole, **extra}


def slow_data(waits: list[float | None], train_s: float | None, workers: int | None, kept: bool = False) -> str | None:
    """The warning for the ranks that waited for their batches DATA_WARN of their training time or more
    (`waits`: each rank's timing.data_wait), with what would keep their loader ahead (`kept`: its workers are
    persistent already); None when none did."""
    slow = [(rank, w) for rank, w in enumerate(waits) if w is not None and w >= DATA_WARN]
    if not slow or train_s is None or train_s < DATA_WARN_S:
        return None
    rank, worst = max(slow, key=lambda rw: rw[1])
    who = f"rank {rank}" if len(waits) == 1 or len(slow) == 1 else f"rank(s) {', '.join(str(r) for r, _ in slow)}"
    if workers is None:
        fix = "an iterable of your own: a DataLoader with workers (run.loader) prepares batches while a step computes"
    elif workers == 0:
        fix = ("the loader has no workers: data.num_workers=4 (run.loader's; a DataLoader of your own: its "
               "num_workers) prepares batches in the background while a step computes")
    else:
        keep = "" if kept else "persistent_workers=True (no new workers at each epoch), "
        fix = f"the loader has {workers} worker(s): more of them, {keep}or less work in the dataset's __getitem__"
    return (f"{who} waited for batches {100 * worst:.0f}% of the training time (run.steps taking the next one "
            f"from the loader and moving it to the device; result.json's plan[].data_wait): the data, not the "
            f"model, set the pace; {fix}")
