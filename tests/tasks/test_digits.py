"""The built-in digits dataset: scikit-learn's own data and split, read without importing sklearn."""

from __future__ import annotations

import subprocess
import sys

import torch


def test_the_images_are_sklearns_load_digits_and_the_splits_partition_them():
    from sklearn.datasets import load_digits

    from expgpu.tasks.digits import Digits, _bundled_csv, images

    assert _bundled_csv() is not None   # the fast path is the one taken here
    bunch = load_digits()
    x, y = images()
    assert torch.equal(x, torch.tensor(bunch.data, dtype=torch.float32) / 16.0)
    assert torch.equal(y, torch.tensor(bunch.target, dtype=torch.long))
    train, test = Digits("train"), Digits("test")
    assert (len(train), len(test)) == (1438, 359)
    seen = torch.cat([train.inputs, test.inputs])
    assert torch.equal(seen.sum(0), x.sum(0))   # every image in exactly one split
    assert not torch.equal(Digits("test", seed=1).targets, test.targets)


def test_importing_the_task_module_does_not_import_sklearn():
    # sklearn's import is ~0.9 s, paid by a pool's fork server before its first job
    code = "import sys, expgpu.tasks.digits; print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
