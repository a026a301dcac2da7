"""The checks of how a training function uses Run that are said, not refused (a task may mean it): modules that
no gradient sync keeps in step, a first step whose gradients came around DDP, a model left in eval mode while it
trains. Each is a warning on rank 0, where the task's code is the same on every rank. A mixin of Run: it reads
the tracked objects and what run.wrap wrapped."""

from __future__ import annotations

import logging

from expgpu.distributed.wrap import bypassed, count_forwards, unsynced
from expgpu.train.modes import ModeWatch

log = logging.getLogger("expgpu")


class RunChecks:
    def _warn_unsynced(self) -> None:
        """Before the first step, on rank 0: tracked modules that no rank's gradients will keep in step."""
        names = unsynced(self._state.objects, self._wrap, self.world_size, self._wrapped_any) if self.is_main else []
        if names:
            log.warning("run.wrap was not called: on %d ranks each trains its own copy of %s, with no gradient sync "
                        "(launch.wrap=%s wraps what run.wrap is given), and the checkpoint keeps rank 0's: "
                        "model = run.wrap(model) before the loop; launch.wrap=none where each rank is to train alone; "
                        "a DDP of your own: track it, not the module inside", self.world_size,
                        ", ".join(names), self._wrap)

    def _watch_first_steps(self) -> None:
        """As the loop begins: DDP's forwards counted from here (bypassed), and rank 0's watch of the modules'
        train/eval mode."""
        count_forwards(self._wrapped)
        watch = ModeWatch(self._state.objects) if self.is_main else None
        self._modes = watch if watch is not None and watch.modules else None

    def _warn_bypassed(self) -> None:
        """After the first step, on rank 0: a module wrapped in DDP whose gradients DDP never saw (no forward
        through it)."""
        for module in self._wrapped if self.is_main else ():
            said = bypassed(module)
            if said is not None:
                log.warning("%s", said)

    def _check_modes(self, modes: ModeWatch, step: int) -> None:
        """At a step's end, on rank 0: a module that trained a whole step in eval mode."""
        said = modes.check(step)
        if said is not None:
            log.warning("%s", said)
