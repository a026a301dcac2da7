"""Small task functions for the Run API tests (`--config-dir tests/conf`, tests/ on PYTHONPATH).

Each does one thing a user's loop does, and leaves what the test checks in the run dir."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import signal
import sys
import time
from typing import Literal, Optional

import torch

from expgpu import Run


def draws(run: Run, steps: int = 3):
    """Every rank writes the random numbers it drew: the same on all ranks, or its own."""
    net = run.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)))
    run.track(net=net)
    out = []
    for step, _ in run.steps(None, steps):
        out.append(net(torch.ones(1, 4)).sum().item())
    (run.run_dir / f"draws{run.rank}.json").write_text(json.dumps([torch.rand(2).tolist(), out]))
    return {"rank0_draw": out[-1]}


def logs(run: Run, max_steps: int = 12, eval_at: int = 6):
    """run.log every step, once more at an odd step, and after the loop."""
    seen = []
    for step, batch in run.steps(None, max_steps):
        seen.append((step, batch))
        run.log(x=torch.tensor(float(step)))
        if step == eval_at:
            run.log(ev=1.5)
    run.log(after=7)
    return {"steps_seen": len(seen), "batches_none": int(all(b is None for _, b in seen)),
            "first": seen[0][0] if seen else -1}


def logs_window(run: Run, max_steps: int = 30):
    """x = (step + 1) / 3 every step (float32: a sum kept in float64 would differ), y = step / 4 as a
    Python float every third step. With PROBE_STOP_AT=k rank 0 sends SIGTERM, as a user's `kill PID`,
    to the `python -m expgpu` that started it, in the body of step k."""
    stop_at = int(os.environ.get("PROBE_STOP_AT", "-1"))
    for step, _ in run.steps(None, max_steps):
        run.log(x=torch.tensor(step + 1.0) / 3)
        if step % 3 == 0:
            run.log(y=step / 4)
        if run.is_main and step == stop_at:
            os.kill(launcher_pid(), signal.SIGTERM)
            time.sleep(2)   # forwarded to every rank: this one has it before its next stop poll


def launcher_pid() -> int:
    """The `python -m expgpu` that started this rank: its parent, or, for a rank forked from a
    warm process, that one's parent (expgpu.launch.warm) or the launcher of this run's dir
    (expgpu.warm_server, which outlives launches)."""
    import psutil

    parent = psutil.Process().parent()
    if "expgpu.launch.warm" in parent.cmdline():
        parent = parent.parent()
    elif "expgpu.warm_server" in parent.cmdline():
        run_dir = f"hydra.run.dir={sys.argv[-1]}"
        parent = next(p for p in psutil.process_iter(["cmdline"]) if run_dir in (p.info["cmdline"] or []))
    return parent.pid


def tracks(run: Run, max_steps: int = 4):
    """Tracks a module under the name in PROBE_TRACK (code that changed between two runs)."""
    run.track(**{os.environ.get("PROBE_TRACK", "model"): run.wrap(torch.nn.Linear(2, 2))})
    for _ in run.steps(None, max_steps):
        pass


def unwrapped(run: Run, max_steps: int = 4):
    """Trains a module on every rank without run.wrap: no gradient sync (each rank its own data and copy)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(model=model, opt=opt)
    data = torch.Generator().manual_seed(run.rank)   # each rank its own share of the data
    for _ in run.steps(None, max_steps):
        loss = model(torch.randn(4, 2, generator=data)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


class TwoHeads(torch.nn.Module):
    """A body and two heads, as a multi-task model: a step trains one head."""

    def __init__(self):
        super().__init__()
        self.body, self.head_a, self.head_b = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, x, head: str = "a"):
        h = torch.relu(self.body(x))
        return self.head_a(h) + self.head_b(h) if head == "both" else (self.head_a if head == "a" else self.head_b)(h)

    def loss(self, x):
        return self(x, "both").pow(2).mean()


def two_heads(run: Run, max_steps: int = 6, find_unused: Optional[bool] = None):
    """Rank 0 trains head_a and rank 1 head_b (each rank's loss leaves the other head out); `find_unused`:
    run.wrap's keyword (None: not given, launch.ddp's then)."""
    options = {} if find_unused is None else {"find_unused_parameters": find_unused}
    model = run.wrap(TwoHeads(), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(model=model, opt=opt)
    for _ in run.steps(None, max_steps):
        loss = model(torch.ones(4, 2), "a" if run.rank == 0 else "b").pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"find_unused": int(model._forward_module.find_unused_parameters)}


def around_ddp(run: Run, max_steps: int = 6, how: str = "method"):
    """Each step's loss from a method of the module (how=method), as Lightning-style code computes it, or through
    the forward (how=forward); each rank its own data."""
    model = run.wrap(TwoHeads())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(model=model, opt=opt)
    data = torch.Generator().manual_seed(run.rank)
    for _ in run.steps(None, max_steps):
        x = torch.randn(4, 2, generator=data)
        loss = model.loss(x) if how == "method" else model(x, "both").pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


class Sleepy(torch.utils.data.Dataset):
    """Items that take `ms` milliseconds each to read."""

    def __init__(self, ms: float):
        self.ms = ms

    def __len__(self):
        return 1024

    def __getitem__(self, i):
        time.sleep(self.ms / 1000)
        return torch.ones(64)


def data_bound(run: Run, item_ms: float = 1.0, matmuls: int = 0, max_steps: int = 60):
    """Batches of 4 items of `item_ms` each, and a step of `matmuls` 4096 x 4096 products on the device (a GPU
    computes them while the next batch is read; the loop never waits for the GPU)."""
    w = torch.randn(4096, 4096, device=run.device) / 64
    model = run.wrap(torch.nn.Linear(64, 1))
    for step, x in run.steps(run.loader(Sleepy(item_ms), batch_size=4), max_steps):
        y = w
        for _ in range(matmuls):
            y = torch.tanh(y @ w)
        run.log(loss=model(x).sum() + y.mean())


def track_no_state(run: Run):
    run.track(thing=object())


def track_a_name_twice(run: Run):
    model = torch.nn.Linear(2, 1)
    best = {"loss": 1.0}
    run.track(model=model, best=best)
    run.track(model=model, best=best)   # the same objects again: no change
    run.track(model=torch.optim.SGD(model.parameters(), lr=0.1))   # the model would be out of the checkpoint


def raises(run: Run, rank: int = 1, at: int = 3, max_steps: int = 50):
    for step, _ in run.steps(None, max_steps):
        if run.rank == rank and step == at:
            raise ValueError(f"probe failure on rank {run.rank} at step {step}")


def returns(run: Run, kind: str = "list"):
    return [1.0] if kind == "list" else {"name": "text"}


def typed(run: Run, lr: float, steps: int = 2, flag: bool = False, label: str = "x"):
    return {"lr": lr, "steps": steps, "flag": flag, "lr_type_float": int(isinstance(lr, float))}


def log_vector(run: Run):
    for _ in run.steps(None, 3):
        run.log(v=torch.ones(3))


def log_epoch(run: Run):
    for step, _ in run.steps(None, 30):
        run.log(loss=1.0 / (step + 1), epoch=step // 10)


class NoisyPairs(torch.utils.data.Dataset):
    """Regression pairs with augmentation noise from torch, Python's random and NumPy, drawn in
    whichever process fetches the sample (a DataLoader worker when there are workers)."""

    def __init__(self, n: int = 512):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        import random

        import numpy as np

        return self.x[i] + torch.randn(8) * 0.1 + random.random() * 0.01 + float(np.random.rand()) * 0.01, self.y[i]


def augments(run: Run, max_steps: int = 40, workers: int = 2):
    """A loop over a dataset that augments in its DataLoader workers."""
    model = run.wrap(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run.track(model=model, opt=opt)
    loader = run.loader(NoisyPairs(), batch_size=16, num_workers=workers)
    for step, (x, y) in run.steps(loader, max_steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log(loss=loss)
    return {"loss": loss.item(), "dataset_len": len(loader.dataset)}


def reduces(run: Run, op: str = "sum", extra_on: int = -1):
    """run.all_reduce of what each rank computed, and run.barrier after rank 0's slow write."""
    import time

    r = run.rank
    mine = {"tensor": torch.tensor([1.0, 2.0]) * (r + 1), "ints": torch.tensor([r, 10]), "number": r + 1,
            "float": 0.5 * (r + 1), "numpy": __import__("numpy").float32(r + 1),
            "array": __import__("numpy").array([r, 1])}
    if r == extra_on:
        mine["extra"] = 1.0
    if r % 2:   # another insertion order on odd ranks: the keys still pair up
        mine = dict(reversed(list(mine.items())))
    out = run.all_reduce(mine, op=op)
    if run.is_main:
        time.sleep(1.0)
        (run.run_dir / "ready").write_text("x")
    run.barrier()
    seen = (run.run_dir / "ready").exists()
    as_lists = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in out.items()}
    types = {k: type(v).__name__ for k, v in out.items()}
    (run.run_dir / f"reduced{r}.json").write_text(json.dumps({"out": as_lists, "types": types, "keys": list(out),
                                                              "seen_ready": seen, "mine_kept": mine["number"]}))
    return {"total": run.all_reduce(float(r + 1), op=op)}


def gathers(run: Run, examples: int = 9, bad: str = ""):
    """An evaluation whose metric needs every prediction (run.gather), and rank 0's choice on every rank
    (run.broadcast); `bad`: a misuse (shape: another trailing shape on rank 1; src: a rank that is not)."""
    data = torch.utils.data.TensorDataset(torch.arange(examples), torch.arange(examples).float() / examples)
    ids, scores = [], []
    for index, target in run.loader(data, batch_size=2, shuffle=False, drop_last=False):
        ids.append(index)
        scores.append(target * 2)
    mine = {"ids": torch.cat(ids), "scores": torch.cat(scores).unsqueeze(1)}
    if bad == "shape" and run.rank == 1:
        mine["scores"] = mine["scores"].repeat(1, 2)
    out = run.gather(mine)
    choice = run.broadcast({"picked": f"rank {run.rank}"}, src=5 if bad == "src" else 0)
    seen = {"ids": out["ids"].tolist(), "scores": out["scores"].squeeze(1).tolist(), "shares": len(mine["ids"]),
            "zero_d": run.gather(torch.tensor(run.rank * 10)).tolist(), "numbers": run.gather(run.rank + 1),
            "words": run.gather([f"w{run.rank}"]), "choice": choice}
    (run.run_dir / f"gathered{run.rank}.json").write_text(json.dumps(seen))
    return {"examples": len(seen["ids"])}


def breaks(run: Run, max_steps: int = 60, stop_at: int = 0):
    """Early stopping: the loop breaks out of run.steps after step `stop_at` (0: never)."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4, generator=g), torch.randn(256, 1, generator=g))
    model = run.wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run.track(model=model, opt=opt)
    for step, (x, y) in run.steps(run.loader(data, batch_size=8), max_steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log(loss=loss)
        if step + 1 == stop_at:
            break
    return {"loss": loss.item()}


class Opt(enum.Enum):
    ADAM = "adam"
    SGD = "sgd"


def containers(run: Run, layers: list[int] = (8,), betas: tuple[float, float] = (0.9, 0.99),
               sizes: Optional[dict[str, int]] = None, mode: Literal["a", "b"] = "a", opt: Opt = Opt.ADAM):
    """Annotated containers and choices: what arrives, and as what."""
    (run.run_dir / "params.json").write_text(json.dumps({
        "layers": layers, "betas": betas, "sizes": sizes, "mode": mode, "opt": opt.value,
        "types": [type(layers).__name__, type(betas).__name__, type(betas[0]).__name__,
                  type(sizes).__name__, type(layers[0]).__name__]}))


def keeps_best(run: Run, max_steps: int = 20):
    """The best loss so far, in a plain dict that run.track restores in place."""
    best = {"loss": float("inf"), "step": -1}
    run.track(best=best)
    for step, _ in run.steps(None, max_steps):
        loss = abs(10 - step) + 0.5   # lowest at step 10
        if loss < best["loss"]:
            best.update(loss=loss, step=step, mean=__import__("numpy").float64(loss))   # a NumPy scalar too
    return best


class NumpyState:
    """A user's object whose state_dict holds a NumPy array, which tensors-only loading refuses."""

    def __init__(self):
        import numpy as np

        self.seen = np.zeros(2)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def tracks_numpy(run: Run, max_steps: int = 3):
    run.track(counts=NumpyState())
    for _ in run.steps(None, max_steps):
        pass


def paced(run: Run, step_s: float = 1.0, max_steps: int = 12):
    """Steps of `step_s` seconds (DDP keeps the ranks in step); rank 0 writes the step it is in to
    `at`, so that a test can send a signal during a given step."""
    import time

    net = run.wrap(torch.nn.Linear(2, 1))
    run.track(net=net)
    for step, _ in run.steps(None, max_steps):
        if run.is_main:
            (run.run_dir / "at").write_text(str(step))
        time.sleep(step_s)
        net(torch.ones(1, 2)).sum().backward()
    return {"steps_done": run.step}


@dataclasses.dataclass
class Shape:
    width: int = 4
    depth: int = 2


@dataclasses.dataclass
class ProbeConfig:
    """A script's config block, kept as it is: the task keys are its fields."""
    lr: float = 0.1
    max_iters: int = 6
    shape: Shape = dataclasses.field(default_factory=Shape)
    tags: tuple[str, ...] = ()
    seed: int = 0


def configured(run: Run, cfg: ProbeConfig):
    """Takes its parameters as one dataclass; reports what it got."""
    for _ in run.steps(None, cfg.max_iters):
        pass
    return {"lr": cfg.lr, "width": cfg.shape.width, "depth": cfg.shape.depth, "n_tags": len(cfg.tags),
            "seed": cfg.seed, "is_config": int(isinstance(cfg, ProbeConfig) and isinstance(cfg.shape, Shape))}


def mapped(run: Run, config: dict):
    """Takes its parameters as one plain mapping."""
    return {"n_keys": len(config), "lr": config["lr"]}


def torchrun_env(run: Run):
    """Code written for torchrun: who this process is, from torchrun's variables."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    (run.run_dir / f"env{run.rank}.json").write_text(json.dumps({n: os.environ.get(n) for n in names}))


def prints(run: Run):
    """A script's print(), on every rank."""
    print(f"printed by rank {run.rank}")


def keeps_unknown(run: Run):
    """keep= names a variable its function does not have."""
    hidden = None
    for _ in run.steps(None, 2, keep=("hiden",)):
        hidden = 1
    return {"hidden": hidden}


def lengthy(run: Run, max_iters: int = 6, twice: int = 0, inclusive: bool = False, decay_iters: int = 0):
    """Its loop's length is its own parameter, max_iters (or 2 x twice, a length no key holds); with
    `inclusive`, nanoGPT's loop to max_iters inclusive, beside a decay_iters that may equal it."""
    net = run.wrap(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1 if decay_iters >= 0 else 0.2)
    run.track(net=net, opt=opt)
    for _ in run.steps(None, 2 * twice if twice else max_iters + 1 if inclusive else max_iters):
        opt.zero_grad()
        net(torch.randn(3, 2)).pow(2).mean().backward()
        opt.step()


def prefetching(run: Run, max_steps: int = 12):
    """nanoGPT's shape: the next batch is fetched at the end of a step, outside what a checkpoint holds."""
    data = torch.randn(256, 2)

    def get_batch():
        return data[torch.randint(0, len(data), (8,))]

    net = run.wrap(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    run.track(net=net, opt=opt)
    x = get_batch()
    for _ in run.steps(None, max_steps):
        loss = net(x).pow(2).mean()
        x = get_batch()   # prefetch, as nanoGPT does while the GPU works
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log(loss=loss)


def process(run: Run):
    """Where this rank's process came from and what it runs with: its threads, its parent."""
    import psutil

    parent = psutil.Process().parent()
    by = next((warm for warm in ("expgpu.launch.warm", "expgpu.warm_server") if warm in parent.cmdline()), None)
    (run.run_dir / f"process{run.rank}.json").write_text(json.dumps({
        "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
        "forked": by is not None, "forked_by": by, "rank_env": os.environ.get("EXPGPU_RANK"),
        "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path[:3]}))
