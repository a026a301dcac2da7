"""`Run`: the one object a training function meets. `def train(run, **params)`, called on every rank.

    def train(run: Run, lr: float = 1e-3, max_steps: int = 1000):
        model = run.wrap(Net())                                  # on run.device, DDP across ranks
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        loader = run.loader(dataset, batch_size=64)              # this rank's shard, resumable
        run.track(model=model, opt=opt)                          # restored on a resume
        for step, (x, y) in run.steps(loader, max_steps):        # batches already on run.device
            with run.autocast():
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            run.log(loss=loss)                                   # read back every log_every steps
        return {"loss": loss.item()}                             # result.json's metrics

Everything the loop should not have to write lives here: where the data stands, every rank's RNG,
stop signals (all ranks stop at one step, save and exit), checkpoint cadence, rank-0 logging and
progress. Everything the user decides (models, optimizers, the step itself) stays in their code,
as with Lightning Fabric; unlike Fabric, a stopped and resumed run ends with exactly the
parameters of an uninterrupted one, without user code for it.

A step is one iteration of run.steps on every rank: one global batch of (batch size x world size)
examples, one optimizer step in a usual loop. The checkpoint (checkpoint.pt in the run dir, made
and restored by expgpu.checkpoint.state) holds the tracked objects' state_dict() from rank 0 (DDP keeps the
ranks' copies equal) and, for every rank, its RNG states and its position in the data.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from expgpu import faults
from expgpu.checkpoint import world_change
from expgpu.checkpoint.keep import names_of
from expgpu.checkpoint.state import CheckpointState
from expgpu.config import checkpoint_format
from expgpu.distributed import group, rng
from expgpu.distributed.wrap import ddp_options, wrap
from expgpu.errors import UserError
from expgpu.loggers.jsonl import LOG_FORMS, ROW_KEYS, MetricsLog, WindowMeanLog, positional_values
from expgpu.loggers.nonfinite import NonFinite
from expgpu.procs.hang_rules import DATA_OUT, MAX_DONE
from expgpu.procs.stop_signals import DIVERGED, NEVER
from expgpu.train.batches import END_OF_EPOCH, Feed
from expgpu.train.loaders import RankLoaders, check_loader_args
from expgpu.train.run_args import check_steps, epochs_range
from expgpu.train.run_checkpoint import RunCheckpoint, StopTraining
from expgpu.train.run_checks import RunChecks
from expgpu.train.run_collectives import RunCollectives
from expgpu.train.run_end import RunEnd

__all__ = ["Run", "StopTraining"]   # StopTraining lives with the saves (run_checkpoint); `expgpu` exports both

log = logging.getLogger("expgpu")


class Run(RunCheckpoint, RunEnd, RunCollectives, RunChecks):
    """What a training function gets: where it runs, and the few calls that make a loop resumable."""

    def __init__(self, *, info, device, run_dir: Path, cfg: dict, spec, agreement, wrap: str = "ddp",
                 n_gpus: int = 1, gpu_speed: float | None = None, sinks=()):
        from omegaconf import OmegaConf

        self.rank: int = info.rank
        self.local_rank: int = info.local_rank
        self.local_world_size: int = info.local_world_size
        self.world_size: int = info.world_size
        self.is_main: bool = info.rank == 0
        self.device = device
        self.run_dir = Path(run_dir)
        self.cfg = OmegaConf.create(cfg)
        OmegaConf.set_readonly(self.cfg, True)
        self.precision: str = spec.precision
        self.step = 0                      # steps done: what run.steps yields next
        self.max_steps: int | None = None
        self.length_keys: list[str] = []   # the task keys whose value is the loop's length (_begin)
        self.resumed_from_step: int | None = None
        self.stop_signal: str | None = None
        self._spec, self._agreement, self._wrap, self._n_gpus = spec, agreement, wrap, n_gpus
        self._wrapped_any = False   # run.wrap was called (several ranks without it: no gradient sync)
        self._wrapped: list = []    # what it wrapped in DDP: checked after the first step (bypassed)
        self._modes = None          # rank 0's ModeWatch for a model left in eval mode (expgpu.train.modes)
        self._state = CheckpointState(self.run_dir, spec, self.rank, self.world_size, device,
                                      checkpoint_format(self.cfg), self.cfg.checkpoint.get("async_save", False),
                                      self.cfg.backend.timeout_s, (cfg.get("faults") or {}).get("slow_write_s") or 0.0,
                                      chosen=self.cfg.checkpoint.get("format", "auto") != "auto")
        self._feed: Feed | None = None
        self._loaders = RankLoaders(self._state, self.cfg, device, self.world_size, self.rank, spec.seed)
        self._epochs: int | None = None    # how many epochs run.epochs loops over
        self._first_epoch = 0              # and the number of its first (run.epochs(start, stop))
        self._epoch = 0                    # under run.epochs: the epoch now (its steps, or its own code)
        self._pending: dict | None = None  # the checkpoint read, until the loop reaches where it resumes
        self._in_step = False
        self._saved_at: int | None = None
        self._stopped = False
        self._in_steps = False  # inside run.steps (a step's body included)
        self._phase = "train"   # what the loop does between steps (the watchdog reads it: progress())
        self._ended = ""        # the task function has ended: hang_rules.ENDED_IN_STEP (inside run.steps) or ENDED
        self._steps_over = ""   # its last loop is over: why (hang_rules.DATA_OUT or MAX_DONE); no step follows
        # task.log_reduce chooses the class once: run.log, called every step, tests nothing for it
        log_class = WindowMeanLog if spec.log_reduce == "mean" else MetricsLog
        # rank 0's rows also go to `sinks` (expgpu.loggers.base.Sink: the chosen loggers, a sweeper's trial); under
        # task.on_nonfinite=stop a loss that becomes nan there asks every rank to stop, agreed as a signal is
        diverged = functools.partial(agreement.signals.request, DIVERGED) if spec.on_nonfinite == "stop" else None
        self._metrics = log_class(self.run_dir, sinks=sinks, nonfinite=NonFinite(diverged)) if self.is_main else None
        self._gpu_speed = gpu_speed
        self._start_step = 0
        self._timing: dict[str, float | None] = {"first_step_at": None, "t10": None, "end": None}
        # seconds run.steps waited for batches (taking the next from the loader, moving it to the device); None
        # until it takes one from a loader: the share of the time that was, in the rows and result.json
        self._waited: float | None = None
        self._loader_workers: tuple[int | None, bool] = (None, False)
        # What the task adds to result.json beside expgpu's own keys (the built-in loop: its data split,
        # and "step_means", what one step of run.steps stands for, when it is more than one iteration)
        self.result_extra: dict[str, Any] = {}
        self._faults = cfg.get("faults") or {}
        rng.seed_all(spec.seed + (self.rank if spec.seed_per_rank else 0))

    @property
    def epoch(self) -> int:
        return self._feed.epoch if self._feed is not None else self._epoch

    @property
    def gpu_speed(self) -> float | None:
        """This rank's GPU score (gpu_map's, or measured), which data.shard=proportional splits the
        global batch by; None without GPUs or scores."""
        return self._gpu_speed

    @property
    def _started(self) -> bool:
        return self._feed is not None or self._epochs is not None

    # -- models and data -------------------------------------------------------------------------

    def wrap(self, module, **ddp):
        """`module` on run.device, wrapped as launch.wrap says: DDP when the world has more than one
        rank, DataParallel for `dp` over this rank's GPUs, nothing for `none`. Returns what to train:
        called, it runs through DDP; its other attributes and methods are your module's own. `ddp`:
        DistributedDataParallel's own options (find_unused_parameters=True, static_graph=True, ...) over
        launch.ddp's, used where it builds a DDP."""
        options = ddp_options(dict(self.cfg.launch.get("ddp") or {}), ddp)
        self._wrapped_any = True
        wrapped = wrap(module.to(self.device), self.device, self._wrap, self.world_size, self._n_gpus,
                       fsdp=self.cfg.launch.get("fsdp"), precision=self.precision, ddp=options)
        if getattr(wrapped, "_expgpu_wrapped", False):
            self._wrapped.append(wrapped)
        return wrapped

    def loader(self, dataset, batch_size: int, shuffle: bool = True, drop_last: bool = True, **kwargs):
        """This rank's DataLoader over `dataset`: every rank takes a disjoint share of each epoch
        (the permutation is seeded by task.seed and the epoch), pin_memory on CUDA, data.num_workers
        workers unless given. Its position is part of the checkpoint when it drives run.steps. With
        workers, the random numbers the dataset draws in them are seeded per batch by the batch's
        place (expgpu.train.batches.SeededFetch), so a resumed run draws the same; loader.dataset then
        wraps `dataset` (its attributes read through).

        drop_last=False shares out every example exactly once (ranks may differ by one batch):
        the choice for evaluation."""
        check_loader_args(dataset, batch_size, kwargs)
        return self._loaders.build(dataset, batch_size, shuffle, drop_last, drop_last, **kwargs)

    def rank_batch(self, batch_size: int, what: str = "batch_size") -> int:
        """This rank's batch now for `batch_size` per rank at the world size the run started with:
        the same global batch on this world after a resume on another number of ranks (run.loader
        applies it itself). A world that cannot share it equally is one line naming `what`, exit 2."""
        mine = self._state.rank_batch(batch_size, self.cfg.checkpoint.resume)
        if mine is None:
            why = world_change.indivisible(what, batch_size, self.start_world_size, self.world_size)
            raise UserError(f"checkpoint {self._state.path} is of a run {why}")
        return mine

    @property
    def start_world_size(self) -> int:
        """The number of ranks the run started with, which per-rank batch sizes are counted at."""
        if self.cfg.checkpoint.resume:
            self._state.peek()   # read once, before the loop (rank_batch, run.loader)
        return self._state.start_world

    def track(self, **objects) -> None:
        """Objects whose state_dict() is checkpointed and restored on a resume: modules (wrapped or
        not), optimizers, schedulers, GradScaler, your own (rank 0's state); a dict of numbers and
        tensors is each rank's own, restored in place on that rank. Call before the loop."""
        if self._started:
            raise UserError(f"run.track({', '.join(objects)}): called after the training loop began; a resume "
                            "restores tracked objects before the first step, so track them before the loop")
        for name, obj in objects.items():
            self._state.add(name, obj)

    # -- the loop --------------------------------------------------------------------------------

    def steps(self, loader, max_steps: int | None = None, accumulate: int = 1,
              keep: str | Iterable[str] = ()) -> Iterator[tuple[int, Any]]:
        """(step, batch) for step = the steps done so far .. max_steps - 1, batches on run.device;
        inside `for epoch in run.epochs(n)`, run.steps(loader) is that epoch's batches instead,
        (i, batch) with i the batch's index in the epoch, as enumerate(loader) gives it.

        `loader`: from run.loader (resumes exactly), a DataLoader of your own without a sampler of
        its own (rebuilt as run.loader builds one), any iterable (a resumed epoch skips the batches
        seen), or None (batch is None: loops that draw their own data). `accumulate` > 1: batch
        is a list of that many batches (micro-batches of one optimizer step). `keep`: the names of
        the calling function's variables the loop carries across steps (expgpu.checkpoint.keep)."""
        check_steps(max_steps, accumulate, in_epochs=self._epochs is not None, begun=self._feed is not None)
        self._keep(keep, "run.steps", sys._getframe(1))
        if self._epochs is not None:
            return self._epoch_steps(Feed(self._loaders.shared_out(loader), self.device, accumulate, one_epoch=True))
        self.max_steps = max_steps
        self._feed = Feed(self._loaders.shared_out(loader), self.device, accumulate)
        return self._loop(max_steps)

    def epochs(self, n: int, stop: int | None = None, keep: str | Iterable[str] = ()) -> Iterator[int]:
        """`for epoch in run.epochs(n): ... for i, batch in run.steps(loader): ...`: a loop over
        epochs with the code of its own around each epoch's steps (evaluation, a scheduler stepped
        per epoch). The epochs are numbered as range(n) or, with `stop`, range(n, stop) (a script's
        `range(1, epochs + 1)`). Steps count on across epochs; a stop mid-epoch resumes at that step
        of that epoch (what the epoch's start did to tracked objects is restored as it was at the stop).
        `keep`: the names of the calling function's variables the epochs carry (expgpu.checkpoint.keep)."""
        start, stop = epochs_range(n, stop, begun=self._started)
        self._keep(keep, "run.epochs", sys._getframe(1))
        self._epochs, self._first_epoch = max(0, stop - start), start
        return self._epoch_loop(self._epochs)

    def _keep(self, keep, where: str, frame) -> None:
        """keep=: the variables of the function that called run.steps / run.epochs (expgpu.checkpoint.keep)."""
        if keep:
            self._state.kept(where, names_of(keep, where)).bind(frame)

    def _loop(self, max_steps: int) -> Iterator[tuple[int, Any]]:
        self._begin(max_steps, last_poll=max_steps - 1)
        self._resume_into(self._feed)
        yield from self._run_steps(self._feed, max_steps)
        self._steps_over = MAX_DONE if self.step >= max_steps else DATA_OUT
        self._end()

    @property
    def _epoch_end(self) -> int:
        """The number after run.epochs' last epoch."""
        return self._first_epoch + self._epochs

    def _epoch_loop(self, n: int) -> Iterator[int]:
        if self._metrics is not None:
            self._metrics.plan(epochs=n, first_epoch=self._first_epoch)
        self._begin(n)
        first = self._state.where(self._pending)[0] if self._pending is not None else self._first_epoch
        for epoch in range(first, self._epoch_end):
            self._epoch = epoch
            self._resume_into(None)   # saved between epochs: as it was before this one's own code
            yield epoch
            self._count_broken_step()
            self._feed = None   # between epochs: a save here resumes at the next one's start
            self._epoch = epoch + 1
        self._resume_into(None)   # nothing left to train (a finished run rerun): its state, as saved
        self._end()

    def _epoch_steps(self, feed: Feed) -> Iterator[tuple[int, Any]]:
        self._count_broken_step()
        feed.resume(self._epoch, 0)
        self._feed = feed
        self._resume_into(feed)   # the epoch the checkpoint is in: its position, objects, RNG
        left = feed.batches_left()
        if self._epoch == self._epoch_end - 1:   # the run's last step polls too
            self._agreement.set_last(None if left is None else self.step + left - 1)
        if left is not None and self._metrics is not None:   # the run's length, for its progress
            whole = left + feed.position // feed.accumulate
            self._metrics.plan(max_steps=self.step + left + (self._epoch_end - self._epoch - 1) * whole)
        # like enumerate(loader): the batch's index in the epoch (from where a resumed epoch stood)
        yield from self._run_steps(feed, NEVER, index=feed.position // feed.accumulate)
        if self._epoch == self._epoch_end - 1:
            self._steps_over = DATA_OUT   # the last epoch's: no rank may train on past it

    def _run_steps(self, feed: Feed, max_steps: int, index: int | None = None) -> Iterator[tuple[int, Any]]:
        """(the step, or with `index` the batch's index in its epoch counted from it, batch)."""
        every, log_every = self.cfg.checkpoint.every_steps, self._spec.log_every
        should_stop, metrics, start = self._agreement.should_stop, self._metrics, self._start_step
        crash_step = self._faults.get("crash_step")
        self._in_steps = True   # the watchdog tells the loop from the code around it (progress())
        if feed.loader is not None:
            self._loader_workers = (getattr(feed.loader, "num_workers", None),
                                    bool(getattr(feed.loader, "persistent_workers", False)))
            if self._waited is None:   # the first loop that takes batches from a loader: from now on, timed
                self._waited = 0.0
                if metrics is not None:
                    metrics.waited = lambda: self._waited
        clock, idle = time.perf_counter, group.gpu_idle(self.device)
        if self.step == start:
            self._watch_first_steps()
        modes = self._modes
        try:
            while self.step < max_steps:
                fetched = clock()
                batch = feed.next()
                if self._waited is not None and idle():
                    self._waited += clock() - fetched
                if batch is END_OF_EPOCH:
                    return
                if crash_step == self.step:
                    faults.crash(self._faults, self.rank, self.step)
                self._in_step = True
                if index is None:
                    yield self.step, batch
                else:
                    yield index, batch
                    index += 1
                self._in_step = False
                self.step = step = self.step + 1
                if step - start == 1:
                    self._warn_bypassed()
                if modes is not None:
                    self._check_modes(modes, step)
                if step - start == 10:
                    group.sync_device(self.device)
                    self._timing["t10"] = time.time()   # steps/s is measured after 10 warm-up steps
                if step >= max_steps:
                    break   # done: a signal now changes nothing; the last row is written at the end
                if step % log_every == 0 and metrics is not None:
                    metrics.flush(feed.epoch)
                if every and step % every == 0:
                    self._save("every_steps")
                if should_stop(step):
                    self._stop()
        finally:
            self._in_steps = False

    def _end(self) -> None:
        self._agreement.settle()   # the stop poll still in flight: finished before the group goes
        group.sync_device(self.device)
        self._timing["end"] = time.time()
        self._save("end of training")

    def _count_broken_step(self) -> None:
        """A break out of run.steps in a step's body: that step was done."""
        if self._in_step:
            self.step, self._in_step = self.step + 1, False

    def log(self, *named, **scalars) -> None:
        """Numbers or one-element tensors for this step; rank 0 writes them to metrics.jsonl,
        reading tensors back only every task.log_every steps. `run.log(loss=loss)`, or as other tools
        take them: a name and a value (`run.log("loss", loss)`, Lightning's), a dict (`run.log({"loss":
        loss})`, W&B's and accelerate's)."""
        if named:
            values = positional_values(named)
            if values is None:
                raise UserError(f"run.log({', '.join(type(v).__name__ for v in named)}): give {LOG_FORMS}")
            scalars = {**values, **scalars}
        if not ROW_KEYS.isdisjoint(scalars):   # on every rank, so all of them stop at the same call
            taken = ", ".join(sorted(scalars.keys() & ROW_KEYS))
            raise UserError(f"run.log({taken}=...): step, epoch and time are written with every row by expgpu; "
                            "log it under another name")
        if self._metrics is not None:
            self._metrics.log(self.step + 1 if self._in_step else self.step, scalars)

    @contextlib.contextmanager
    def phase(self, name: str):
        """A stretch of the loop that may take long without finishing a step (an evaluation, a long
        save of your own): the hang watchdog gives it `launch.hang.slow_phase_s` instead of the step
        limit, and names it if it hangs.

            with run.phase("evaluation"):
                metrics = evaluate(model, val_loader)
        """
        if not isinstance(name, str) or not name or name == "train":
            raise UserError(f"run.phase({name!r}): name the stretch, e.g. run.phase('evaluation')")
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def autocast(self):
        """The configured task.precision for the forward pass: bf16 or fp16 autocast, or nothing at 32."""
        if self.precision == "32":
            return contextlib.nullcontext()
        import torch

        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    def restart_epoch(self) -> None:
        """Draw the rest of this epoch's batches afresh from the loop's place: after a change of how
        run.loader's global batch is split between ranks (data.shard=auto's rebalance), the next
        global batch is sliced by the new split."""
        if self._feed is None:
            raise UserError("run.restart_epoch(): there is no run.steps loop to restart")
        self._feed.restart()
