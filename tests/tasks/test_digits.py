"""The built-in digits dataset: scikit-learn's own data and split, read without importing sklearn."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import clean_env, multirun


def test_the_images_are_sklearns_load_digits_and_the_splits_partition_them():
    from sklearn.datasets import load_digits

    from expgpu.tasks.digits import Digits, _bundled_csv, images

    assert _bundled_csv() is not None   # the fast path is the one taken here
    bunch = load_digits()
    x, y = images()
    assert torch.equal(torch.from_numpy(x), torch.tensor(bunch.data, dtype=torch.float32) / 16.0)
    assert torch.equal(torch.from_numpy(y), torch.tensor(bunch.target, dtype=torch.long))
    train, test = Digits("train"), Digits("test")
    assert (len(train), len(test)) == (1438, 359)
    seen = torch.cat([train.inputs, test.inputs])
    assert torch.equal(seen.sum(0), torch.from_numpy(x).sum(0))   # every image in exactly one split
    assert not torch.equal(Digits("test", seed=1).targets, test.targets)


def test_importing_the_task_module_does_not_import_sklearn():
    # sklearn's import is ~0.9 s, paid by a pool's fork server before its first job
    code = "import sys, expgpu.tasks.digits; print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a job gets one thread per core")
def test_a_pool_job_on_two_threads_trains_digits(tmp_path):
    # one job on 2 CPU slots gets both threads: a fork of a server that warmed this module, which must
    # not have started torch's thread pool there (its first parallel op would hang)
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    done = multirun(["hydra/launcher=gpu_pool", "hydra.launcher.cpu_slots=2", "task=digits", "task.max_steps=50",
                     "~hydra.callbacks.report"], tmp_path / "sweep", env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = re.search(r"(\d+) threads per job", done.stdout + done.stderr)
    assert threads and int(threads.group(1)) >= 2, done.stdout[-2000:]
    assert json.loads((tmp_path / "sweep" / "0" / "result.json").read_text())["status"] == "finished"
