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
examples, one optimizer step in a usual loop. The checkpoint (checkpoint.pt in the run dir) holds
the tracked objects' state_dict() from rank 0 (DDP keeps the ranks' copies equal) and, for every
rank, its RNG states and its position in the data.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

from expgpu import checkpoint, dist, loggers, rng, rundir
from expgpu.errors import UserError, first_line
from expgpu.feed import Feed, RankSampler, SeededFetch
from expgpu.metrics import ROW_KEYS, MetricsLog, WindowMeanLog

log = logging.getLogger("expgpu")


class StopTraining(BaseException):
    """Raised out of run.steps once every rank has saved on a stop signal.

    A BaseException, like KeyboardInterrupt: a training loop's `except Exception` must not
    swallow it. The user's `finally` blocks run; the function returns no result."""


class Run:
    """What a training function gets: where it runs, and the few calls that make a loop resumable."""

    def __init__(self, *, info, device, run_dir: Path, cfg: dict, spec, stopper, wrap: str = "ddp",
                 n_gpus: int = 1, gpu_speed: float | None = None):
        from omegaconf import OmegaConf

        self.rank: int = info.rank
        self.local_rank: int = info.local_rank
        self.world_size: int = info.world_size
        self.is_main: bool = info.rank == 0
        self.device = device
        self.run_dir = Path(run_dir)
        self.cfg = OmegaConf.create(cfg)
        OmegaConf.set_readonly(self.cfg, True)
        self.precision: str = spec.precision
        self.step = 0                      # steps done: what run.steps yields next
        self.max_steps: int | None = None
        self.resumed_from_step: int | None = None
        self.stop_signal: str | None = None
        self._spec, self._stopper, self._wrap, self._n_gpus = spec, stopper, wrap, n_gpus
        self._tracked: dict[str, Any] = {}
        self._feed: Feed | None = None
        self._in_step = False
        self._saved_at: int | None = None
        self._stopped = False
        # task.log_reduce chooses the class once: run.log, called every step, tests nothing for it
        log_class = WindowMeanLog if spec.log_reduce == "mean" else MetricsLog
        self._metrics = log_class(self.run_dir, loggers=loggers.build(cfg, self.run_dir)) if self.is_main else None
        self._gpu_speed = gpu_speed        # this rank's GPU score (data.shard=proportional)
        self._start_step = 0
        self._timing: dict[str, float | None] = {"first_step_at": None, "t10": None, "end": None}
        self._extra: dict[str, Any] = {}   # what the built-in loop adds to result.json (the shard split)
        self._faults = cfg.get("faults") or {}
        rng.seed_all(spec.seed + (self.rank if spec.seed_per_rank else 0))

    @property
    def epoch(self) -> int:
        return self._feed.epoch if self._feed is not None else 0

    # -- models and data -------------------------------------------------------------------------

    def wrap(self, module):
        """`module` on run.device, wrapped as launch.wrap says: DDP when the world has more than one
        rank, DataParallel for `dp` over this rank's GPUs, nothing for `none`. Returns what to train."""
        return dist.wrap(module.to(self.device), self.device, self._wrap, self.world_size, self._n_gpus)

    def loader(self, dataset, batch_size: int, shuffle: bool = True, drop_last: bool = True, **kwargs):
        """This rank's DataLoader over `dataset`: every rank takes a disjoint share of each epoch
        (the permutation is seeded by task.seed and the epoch), pin_memory on CUDA, data.num_workers
        workers unless given. Its position is part of the checkpoint when it drives run.steps. With
        workers, the random numbers the dataset draws in them are seeded per batch by the batch's
        place (expgpu.feed.SeededFetch), so a resumed run draws the same; loader.dataset then
        wraps `dataset` (its attributes read through).

        drop_last=False shares out every example exactly once (ranks may differ by one batch):
        the choice for evaluation."""
        from torch.utils.data import DataLoader, IterableDataset

        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise UserError(f"run.loader: a {type(dataset).__name__} has no length to share out between ranks; "
                            "pass a map-style Dataset, or iterate your own loader with run.steps(your_loader, n)")
        for key in ("sampler", "batch_sampler", "shuffle", "generator"):
            if key in kwargs:
                raise UserError(f"run.loader: {key}= is expgpu's (the rank's share, resumable); build your own "
                                "DataLoader if you need your own sampler, and pass it to run.steps")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"run.loader: batch_size={batch_size!r} is not allowed: an integer >= 1")
        sampler = RankSampler(len(dataset), self.world_size, self.rank, shuffle, self._spec.seed, drop_last,
                              batch_size)
        kwargs.setdefault("num_workers", self.cfg.data.num_workers)
        kwargs.setdefault("pin_memory", self.device.type == "cuda")
        if kwargs["num_workers"]:   # workers' random draws (augmentation) seeded per batch: exact resume
            dataset, sampler.keyed = SeededFetch(dataset, self._spec.seed), True
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                          generator=sampler.generator, **kwargs)

    def track(self, **objects) -> None:
        """Objects whose state_dict() is checkpointed and restored on a resume: modules (wrapped or
        not), optimizers, schedulers, GradScaler, your own; a dict of numbers is restored in place.
        Call before run.steps."""
        if self._feed is not None:
            raise UserError(f"run.track({', '.join(objects)}): called after run.steps began; a resume restores "
                            "tracked objects before the first step, so track them before the loop")
        for name, obj in objects.items():
            if isinstance(obj, dict):
                obj = _DictState(obj)
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UserError(f"run.track({name}=...): a {type(obj).__name__} has no state_dict() and "
                                "load_state_dict(); track modules, optimizers, schedulers, a GradScaler, "
                                "a dict of numbers, or objects of your own that have both")
            self._tracked[name] = _unwrapped(obj)

    # -- the loop --------------------------------------------------------------------------------

    def steps(self, loader, max_steps: int, accumulate: int = 1) -> Iterator[tuple[int, Any]]:
        """(step, batch) for step = the steps done so far .. max_steps - 1, batches on run.device.

        `loader`: from run.loader (resumes exactly), any iterable (a resumed epoch skips the batches
        seen), or None (batch is None: loops that draw their own data). `accumulate` > 1: batch
        is a list of that many batches (micro-batches of one optimizer step)."""
        if self._feed is not None:
            raise UserError("run.steps: called a second time; a run has one training loop")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
            raise UserError(f"run.steps: max_steps={max_steps!r} is not allowed: an integer >= 0")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise UserError(f"run.steps: accumulate={accumulate!r} is not allowed: an integer >= 1")
        self.max_steps = max_steps
        self._feed = Feed(loader, self.device, accumulate)
        return self._loop(max_steps)

    def _loop(self, max_steps: int) -> Iterator[tuple[int, Any]]:
        self._check_tracked()
        self._resume()
        if self._metrics is not None:
            self._metrics.open(self.step, max_steps, resumed=self.resumed_from_step is not None)
        every, log_every = self.cfg.checkpoint.every_steps, self._spec.log_every
        start = self._start_step = self.step
        if self._stopper.should_stop(self.step, force=True):   # a signal while starting up: save, no steps
            self._stop()
        self._timing["first_step_at"] = time.time()
        feed, should_stop, metrics = self._feed, self._stopper.should_stop, self._metrics
        crash_step = self._faults.get("crash_step")
        while self.step < max_steps:
            batch = feed.next()
            if crash_step == self.step:
                _inject_fault(self._faults, self.rank, self.step)
            self._in_step = True
            yield self.step, batch
            self._in_step = False
            self.step = step = self.step + 1
            if step - start == 10:
                _sync(self.device)
                self._timing["t10"] = time.time()   # steps/s is measured after 10 warm-up steps
            if step >= max_steps:
                break   # done: a signal now changes nothing; the last row is written at the end
            if step % log_every == 0 and metrics is not None:
                metrics.flush(feed.epoch)
            if every and step % every == 0:
                self._save("every_steps")
            if should_stop(step):
                self._stop()
        self._stopper.settle()   # the stop poll still in flight: finished before the group goes
        _sync(self.device)
        self._timing["end"] = time.time()
        self._save("end of training")

    def log(self, **scalars) -> None:
        """Numbers or one-element tensors for this step; rank 0 writes them to metrics.jsonl,
        reading tensors back only every task.log_every steps."""
        if not ROW_KEYS.isdisjoint(scalars):   # on every rank, so all of them stop at the same call
            taken = ", ".join(sorted(scalars.keys() & ROW_KEYS))
            raise UserError(f"run.log({taken}=...): step, epoch and time are written with every row by expgpu; "
                            "log it under another name")
        if self._metrics is not None:
            self._metrics.log(self.step + 1 if self._in_step else self.step, scalars)

    def all_reduce(self, value, op: str = "sum"):
        """`value` summed (or "mean", "max", "min") over all ranks, returned on every rank: a
        tensor (a new one, detached), a number, or a dict of them; as it is on one rank.
        Collective: every rank calls it, with the same keys. For metrics each rank computed on
        its share, e.g. an evaluation's (loss sum, count)."""
        return dist.reduce_value(value, op, self.device)

    def barrier(self) -> None:
        """Every rank waits here for all the others (e.g. while rank 0 downloads the data)."""
        dist.barrier()

    def autocast(self):
        """The configured task.precision for the forward pass: bf16 or fp16 autocast, or nothing at 32."""
        if self.precision == "32":
            return contextlib.nullcontext()
        import torch

        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    # -- checkpoints -------------------------------------------------------------------------------

    def _expect(self) -> dict:
        return {"task": self._spec.name, "world_size": self.world_size, "fingerprint": self._spec.fingerprint}

    def _check_tracked(self) -> None:
        """Objects of the user's own whose state a resume could not load: one line before training.
        Modules, optimizers, schedulers and scalers save tensors and numbers: not copied to check."""
        import torch

        own = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)
        for name, obj in self._tracked.items():
            if not isinstance(obj, own):
                checkpoint.check_loadable(name, obj.state_dict())

    def _resume(self) -> None:
        path = self.run_dir / rundir.CHECKPOINT
        if not (self.cfg.checkpoint.resume and path.exists()):
            return
        state = checkpoint.load(path, self._expect(), self._spec.identity)
        saved, mine = sorted(state["tracked"]), sorted(self._tracked)
        if saved != mine:
            raise UserError(f"checkpoint {path} tracks {', '.join(saved) or 'nothing'}, this run tracks "
                            f"{', '.join(mine) or 'nothing'} (run.track); resume with the same code or use a new run dir")
        for name, obj in self._tracked.items():
            try:
                obj.load_state_dict(state["tracked"][name])
            except UserError:
                raise
            except Exception as e:  # same settings, other code
                raise UserError(f"checkpoint {path}: {name} does not fit what this run tracks as {name} "
                                f"({type(e).__name__}: {first_line(e)}); use a new run dir") from None
        mine_state = state["ranks"][self.rank]
        self.step = self.resumed_from_step = self._saved_at = state["step"]
        self._feed.resume(mine_state["epoch"], mine_state["position"])
        rng.restore(mine_state["rng"], self.device)
        if self._metrics is not None:
            self._metrics.load_state_dict(state.get("metrics", []))
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, self.step, self._feed.epoch,
                 self._feed.position)

    def _save(self, reason: str) -> None:
        """Collective: every rank calls it at the same step."""
        feed = self._feed
        mine = {"rng": rng.capture(self.device), "epoch": feed.epoch, "position": feed.position}
        ranks = dist.gather_objects(mine, self.world_size)
        if self.is_main:
            self._metrics.write_out()   # the rows up to this step are on disk before the checkpoint is
            path = self.run_dir / rundir.CHECKPOINT
            checkpoint.save(path, {
                **self._expect(), "params": _json(self._spec.identity), "step": self.step, "ranks": ranks,
                "tracked": {name: obj.state_dict() for name, obj in self._tracked.items()},
                "metrics": self._metrics.state_dict(),
            })
            log.info("checkpoint at step %d (%s): %s", self.step, reason, path)
        self._saved_at = self.step

    def _stop(self) -> None:
        self._stopper.settle()
        self.stop_signal = self._stopper.agreed
        self._timing["end"] = time.time()
        self._save("stop requested")
        self._stopped = True
        raise StopTraining(self.stop_signal)

    def _close(self, finished: bool) -> None:
        """After the function: the last rows, and a checkpoint if the loop ended early (a break)."""
        try:
            if finished and self._in_step:   # a break in the loop's body: that step was done
                self.step, self._in_step = self.step + 1, False
            if finished and self._feed is not None and self._saved_at != self.step:
                self._stopper.settle()
                _sync(self.device)
                self._timing["end"] = self._timing["end"] or time.time()
                self._save("end of training")
        finally:
            if self._metrics is not None:
                # after a stop, what was logged since the last row is in the checkpoint (written on resume)
                self._metrics.close(self.epoch, flush=not self._stopped, crashed=not finished and not self._stopped)

    def _finish_loggers(self, status: str, metrics: dict) -> None:
        """rank 0: the loggers' runs end (finished, stopped: resumable, failed) with the returned metrics."""
        if self._metrics is not None:
            self._metrics.finish_loggers(status, metrics, self.step)

    def _timings(self, t_start: float) -> dict:
        first, t10, end = self._timing["first_step_at"], self._timing["t10"], self._timing["end"]
        timed = self.step - self._start_step - 10
        return {"startup_s": round(first - t_start, 3) if first else None, "first_step_at": first,
                "train_s": round(end - first, 3) if first and end else None,
                "steps_per_s": round(timed / (end - t10), 2) if t10 and end and timed > 0 else None}

    def _checksum(self) -> str | None:
        """Of every tracked module's state: equal on all ranks when DDP kept them in step."""
        modules = {n: o for n, o in sorted(self._tracked.items()) if hasattr(o, "named_parameters")}
        if not modules:
            return None
        import torch

        h = hashlib.sha256()
        for name, module in modules.items():
            for key, tensor in module.state_dict().items():
                h.update(f"{name}.{key}".encode())
                raw = tensor.detach().to("cpu").contiguous().view(-1)
                h.update(raw.view(torch.uint8).numpy().tobytes())   # any dtype, bf16 too
        return h.hexdigest()[:16]


class _DictState:
    """A plain dict tracked in place (the best metric so far, counters): its items are saved, and
    a resume puts the saved ones back into the same dict object the loop holds."""

    def __init__(self, d: dict):
        self.d = d

    def state_dict(self) -> dict:
        # NumPy scalars (np.mean's result) as Python numbers: torch.load(weights_only=True) reads those
        return {k: v.item() if type(v).__module__ == "numpy" and getattr(v, "ndim", 1) == 0 else v
                for k, v in self.d.items()}

    def load_state_dict(self, state: dict) -> None:
        self.d.clear()
        self.d.update(state)


def _unwrapped(obj: Any) -> Any:
    """The module inside DDP / DataParallel / torch.compile: its state_dict has no wrapper prefix."""
    for _ in range(3):
        inner = getattr(obj, "_orig_mod", None) or (getattr(obj, "module", None)
                                                    if type(obj).__name__ in ("DistributedDataParallel",
                                                                               "DataParallel") else None)
        if inner is None:
            return obj
        obj = inner
    return obj


def _inject_fault(faults: dict, rank: int, step: int) -> None:
    if faults.get("crash_rank") == rank:
        if faults.get("kind") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected crash (faults.crash_rank={rank} faults.crash_step={step})")


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, sort_keys=True, default=str)
