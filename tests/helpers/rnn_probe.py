"""An RNN language model's loop as scripts write it (word_language_model's shape: an init_hidden, a hidden
state carried across batches, epochs with code of their own), for the Run API's epoch and keep= tests
(`--config-dir tests/conf`, tests/ on PYTHONPATH)."""

from __future__ import annotations

import json
import os

import torch

from expgpu import Run


class TinyRNN(torch.nn.Module):
    """A word-level RNN language model in the usual shape: its own init_hidden, a carried state."""

    def __init__(self, vocab: int = 16, hidden: int = 12):
        super().__init__()
        self.hidden_size = hidden
        self.emb, self.rnn = torch.nn.Embedding(vocab, hidden), torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, x, h):
        out, h = self.rnn(self.emb(x), h)
        return self.head(out), h

    def init_hidden(self, batch: int):
        return torch.zeros(1, batch, self.hidden_size, device=self.head.weight.device)


class TokenChunks(torch.utils.data.Dataset):
    """A fixed token stream cut into (input, next-token) chunks."""

    def __init__(self, n: int = 64, bptt: int = 6, vocab: int = 16):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n * bptt + 1,), generator=g)
        self.n, self.bptt = n, bptt

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = self.tokens[i * self.bptt:(i + 1) * self.bptt + 1]
        return s[:-1], s[1:]


def rnnlm(run: Run, epochs: int = 4, lr: float = 0.5):
    """Epochs with code of their own around run.steps, a hidden state carried across steps (each
    rank its own, reset at each epoch's start) and the model's own method through run.wrap.
    PROBE_STEP_S paces the steps (a test signals during a given step)."""
    import time

    step_s = float(os.environ.get("PROBE_STEP_S", "0"))
    raw = TinyRNN()
    model = run.wrap(raw)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = run.loader(TokenChunks(), batch_size=4, shuffle=False)
    carry = {"hidden": None}
    run.track(model=model, opt=opt, carry=carry)
    seen = []
    for epoch in run.epochs(epochs):
        carry["hidden"] = model.init_hidden(4)   # as word_language_model does at each epoch's start
        for i, (x, y) in run.steps(loader):   # i: the batch's index in the epoch, as enumerate's
            if run.is_main:
                (run.run_dir / "at").write_text(str(run.step))
            time.sleep(step_s)
            out, h = model(x, carry["hidden"])
            carry["hidden"] = h.detach()
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.log(loss=loss)
            seen.append([run.step, i])
        run.log(epoch_end=float(epoch))   # the epoch's own code, after its steps
    (run.run_dir / f"seen{run.rank}.json").write_text(json.dumps(seen))
    return {"wrapped_is_raw": int(getattr(model, "module", model) is raw),
            "plain_names": int([n for n, _ in model.named_parameters()][0] == "emb.weight")}


def rnnlm_locals(run: Run, epochs: int = 4, lr: float = 0.5):
    """word_language_model's shape as the script has it: a DataLoader it builds itself (shuffled),
    epochs numbered from 1, and what its loops carry in plain variables (a hidden state and a running
    sum each step, a learning rate annealed and the best sum kept at each epoch's end), kept by name."""
    import time

    step_s = float(os.environ.get("PROBE_STEP_S", "0"))
    model = run.wrap(TinyRNN())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(TokenChunks(), batch_size=4, shuffle=True)
    run.track(model=model, opt=opt)
    seen, starts, best = [], [], None
    for epoch in run.epochs(1, epochs + 1, keep=("lr", "best")):
        starts.append([epoch, lr])   # the epoch's own code reads what the last one left
        hidden, total = model.init_hidden(4), 0.0
        for i, (x, y) in run.steps(loader, keep="hidden total"):
            if run.is_main:
                (run.run_dir / "at").write_text(str(run.step))
            time.sleep(step_s)
            out, hidden = model(x, hidden)
            hidden = hidden.detach()
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            total += loss.item()
            run.log(loss=loss, total=total, lr=lr)
            seen.append([run.step, i, epoch, x.tolist()])
        best = total if best is None else min(best, total)
        lr *= 0.8
    (run.run_dir / f"seen{run.rank}.json").write_text(json.dumps(seen))
    (run.run_dir / f"starts{run.rank}.json").write_text(json.dumps(starts))
    return {"best": best, "lr": lr}
