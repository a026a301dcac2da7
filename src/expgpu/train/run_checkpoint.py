"""The half of expgpu.train.run.Run that reads and writes its checkpoint (expgpu.checkpoint.state): the read
before the first step, the restore where the loop reaches the point it was saved at, the saves (every_steps,
the end, a stop) and the stop itself. A mixin of Run: it reads the state Run keeps."""

from __future__ import annotations

import time

from expgpu.checkpoint import file as checkpoint
from expgpu.checkpoint import world_change
from expgpu.checkpoint.state import KEPT
from expgpu.procs.stop_signals import NEVER
from expgpu.train.batches import Feed
from expgpu.train.loaders import check_feed, global_batch


class StopTraining(BaseException):
    """Raised out of run.steps once every rank has saved on a stop signal.

    A BaseException, like KeyboardInterrupt: a training loop's `except Exception` must not
    swallow it. The user's `finally` blocks run; the function returns no result."""


class RunCheckpoint:
    def _begin(self, length: int, last_poll: int | None = None) -> None:
        """Before the first step: tracked state checked, the checkpoint read (restored by
        _resume_into), rows after it trimmed, and a stop requested while starting up acted on."""
        self._state.check_loadable()
        self._warn_unsynced()
        lengths = checkpoint.length_keys(self._spec.params, length)
        self.length_keys, self._state.length = sorted(lengths), length
        if self.cfg.checkpoint.resume:
            self._pending = self._state.load(lengths)
        if self._pending is not None:
            self.step = self.resumed_from_step = self._saved_at = self._pending["step"]
            if self._metrics is not None:
                self._metrics.load_state_dict(self._pending.get("metrics", []))
        if self._metrics is not None:
            self._metrics.open(self.step, self.max_steps, resumed=self._pending is not None)
        self._start_step = self.step
        if self._agreement.begin(self.step, NEVER if last_poll is None else last_poll):
            self._stop()   # a signal while starting up: no steps (the checkpoint, if any, stays as it is)
        self._timing["first_step_at"] = time.time()

    def _resume_into(self, feed: Feed | None) -> None:
        """The checkpoint read by _begin restored where the loop reaches the point it was saved at.
        Under run.epochs: a save between epochs before the epoch's own code, a save mid-epoch when
        run.steps begins (after the epoch's start reset what the checkpoint holds as it was then)."""
        if self._pending is None:
            return
        epoch, position = self._state.where(self._pending)
        if self._epochs is not None and self._epoch < self._epoch_end and (epoch != self._epoch or
                                                                           (feed is None) != (position == 0)):
            if feed is None and epoch == self._epoch:   # saved mid-epoch: the rest when its run.steps begins,
                self._state.restore_one(KEPT + "run.epochs", self._pending)   # the epochs' variables now
            return
        self._state.restore(self._pending)
        if feed is not None:
            if world_change.changed(self._pending, self.world_size):
                check_feed(self._pending, feed.loader, self.world_size, self._state.path)
            feed.resume(epoch, position)
        self._pending = None

    def _where(self) -> tuple[int, int]:
        """(epoch, batch position) of this rank, as a resume needs it."""
        if self._feed is None:
            return self._epoch, 0
        return self._feed.epoch, self._feed.position

    def _save(self, reason: str) -> None:
        """Collective: every rank calls it at the same step."""
        before, self._phase = self._phase, "checkpoint"
        try:
            self._state.save(self.step, self._where(), self._metrics, reason,
                             global_batch(self._feed.loader if self._feed is not None else None))
        finally:
            self._phase = before
        self._saved_at = self.step

    def _stop(self) -> None:
        self._agreement.settle()
        self.stop_signal = self._agreement.agreed
        self._timing["end"] = time.time()
        if self._pending is None and not self.final_stop:   # _pending: nothing new since the checkpoint was read
            self._save("stop requested")
        self._stopped = True
        raise StopTraining(self.stop_signal)
