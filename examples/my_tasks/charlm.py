"""A character-level language model on Python's own documentation, nanoGPT style.

The text is the reference documentation that ships inside every CPython (pydoc_data.topics,
~460k characters), so nothing is downloaded. A small causal Transformer with dropout, AdamW,
warm-up + cosine learning rate, gradient clipping, autocast (task.precision=bf16 by default),
and an evaluation every `eval_every` steps whose loss and perplexity are all-reduced over ranks.
What expgpu changed from the usual script is marked `# expgpu`.

    PYTHONPATH=examples python -m expgpu --config-dir examples/conf task=charlm
    PYTHONPATH=examples python -m expgpu --config-dir examples/conf task=charlm launch.nproc_per_node=2
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from expgpu import Run


def python_docs() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


class Chunks(Dataset):
    """Windows of `block` characters and the same window one character on."""

    def __init__(self, data: torch.Tensor, block: int):
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i):
        chunk = self.data[i * self.block:(i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, block: int, width: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(block, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.drop(self.tokens(idx) + self.positions(torch.arange(t, device=idx.device)))
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


@torch.no_grad()
def evaluate(run: Run, model: nn.Module, loader, max_batches: int) -> float:
    model.eval()
    total = torch.zeros(2, device=run.device, dtype=torch.float64)   # loss sum, tokens
    for i, (x, y) in enumerate(loader):
        if i == max_batches:
            break
        x, y = x.to(run.device), y.to(run.device)
        with run.autocast():                                               # expgpu: task.precision
            logits = model(x)
        total[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        total[1] += y.numel()
    model.train()
    total = run.all_reduce(total)                                          # expgpu: every rank saw its share
    return float(total[0] / total[1])


def train(run: Run, max_steps: int = 300, batch_size: int = 32, block: int = 64, width: int = 64,
          layers: int = 2, heads: int = 4, dropout: float = 0.1, lr: float = 3e-3, warmup: int = 50,
          clip: float = 1.0, eval_every: int = 100, eval_batches: int = 20):
    text = python_docs()
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([vocab[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train_set, val_set = Chunks(data[:split], block), Chunks(data[split:], block)

    model = CharTransformer(len(vocab), block, width, layers, heads, dropout)
    net = run.wrap(model)                                                  # expgpu: was .to(device) + DDP
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup, max_steps))
    loader = run.loader(train_set, batch_size)                             # expgpu: was DataLoader + sampler
    val_loader = run.loader(val_set, batch_size, shuffle=False, drop_last=False)
    run.track(model=model, opt=opt, sched=sched)                           # expgpu: the checkpoint

    val_loss = float("nan")
    for step, (x, y) in run.steps(loader, max_steps):                      # expgpu: was for epoch / for batch
        with run.autocast():                                               # expgpu: was torch.autocast(...)
            logits = net(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        sched.step()
        run.log(loss=loss, grad_norm=norm, lr=sched.get_last_lr()[0])      # expgpu: was print every N steps
        if (step + 1) % eval_every == 0 or step + 1 == max_steps:
            val_loss = evaluate(run, model, val_loader, eval_batches)
            run.log(val_loss=val_loss, val_perplexity=math.exp(val_loss))
    return {"val_loss": val_loss, "val_perplexity": math.exp(val_loss), "train_loss": loss.item()}
