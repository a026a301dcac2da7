"""A classifier on scikit-learn's 8x8 digits with a metric of its own: macro-F1 over all ranks.

Each rank scores its share of the test split; the confusion matrices are summed across ranks
(all_reduce) before the F1 is computed, so the metric is that of the whole test set. What
expgpu changed from the usual script is marked `# expgpu`.

    PYTHONPATH=examples python -m expgpu --config-dir examples/conf task=digits_f1
    PYTHONPATH=examples python -m expgpu --config-dir examples/conf task=digits_f1 launch.nproc_per_node=2
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from expgpu import Run


def digits(split: str, test_fraction: float = 0.2) -> TensorDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_test = int(len(x) * test_fraction)
    idx = order[:n_test] if split == "test" else order[n_test:]
    return TensorDataset(x[idx], y[idx])


def macro_f1(confusion: torch.Tensor) -> float:
    """confusion[true, predicted] -> the mean over classes of 2PR / (P + R)."""
    tp = confusion.diag().float()
    precision = tp / confusion.sum(dim=0).clamp(min=1)
    recall = tp / confusion.sum(dim=1).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
    return float(f1.mean())


@torch.no_grad()
def confusion_matrix(run: Run, model: nn.Module, loader, classes: int = 10) -> torch.Tensor:
    model.eval()
    confusion = torch.zeros(classes, classes, dtype=torch.int64, device=run.device)
    for x, y in loader:
        x, y = x.to(run.device), y.to(run.device)
        predicted = model(x).argmax(dim=1)
        confusion += torch.bincount(y * classes + predicted, minlength=classes * classes).view(classes, classes)
    model.train()
    return run.all_reduce(confusion)                                       # expgpu: every rank scored its share


def train(run: Run, max_steps: int = 500, batch_size: int = 32, lr: float = 3e-3, hidden: int = 128,
          dropout: float = 0.2, eval_every: int = 100):
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout),
                          nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))
    net = run.wrap(model)                                                  # expgpu: was .to(device) + DDP
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    loader = run.loader(digits("train"), batch_size)                       # expgpu: was DataLoader + sampler
    test_loader = run.loader(digits("test"), 256, shuffle=False, drop_last=False)
    run.track(model=model, opt=opt)                                        # expgpu: the checkpoint

    for step, (x, y) in run.steps(loader, max_steps):                      # expgpu: was for epoch / for batch
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.log(loss=loss)                                                 # expgpu: was print every N steps
        if (step + 1) % eval_every == 0:
            confusion = confusion_matrix(run, model, test_loader)
            run.log(macro_f1=macro_f1(confusion), accuracy=float(confusion.diag().sum() / confusion.sum()))

    confusion = confusion_matrix(run, model, test_loader)
    return {"accuracy": float(confusion.diag().sum() / confusion.sum()), "macro_f1": macro_f1(confusion),
            "final_loss": loss.item()}
