"""The samplers' (epoch, index) keys and SeededFetch, which seeds a worker's random draws per batch
(end to end: test_run_api.py::test_augmentation_in_dataloader_workers_resumes_exactly); the Feed of run.steps
over an iterable of the task's own."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from expgpu.errors import UserError
from expgpu.train import proportional
from expgpu.train.batches import Feed, RankSampler, SeededFetch


class Draws(torch.utils.data.Dataset):
    classes = ["a", "b"]

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i):
        return i, torch.rand(()).item(), random.random()


def test_keyed_samplers_hand_out_the_same_indices_with_their_epoch():
    plain, keyed = (RankSampler(10, 2, 1, True, 0, True, 2) for _ in range(2))
    keyed.keyed = True
    for s in (plain, keyed):
        s.set_epoch(3)
    assert list(keyed) == [(3, i) for i in plain]
    plain, keyed = (proportional.ShareBatchSampler(40, [3, 1], 0, 7, epoch=2) for _ in range(2))
    keyed.keyed = True
    assert list(keyed) == [[(2, i) for i in b] for b in plain]


def test_a_batchs_draws_depend_on_its_key_alone():
    fetch = SeededFetch(Draws(), seed=5)
    first = fetch.__getitems__([(0, 4), (0, 7)])
    torch.rand(3), random.random()                  # whatever was drawn in between
    assert fetch.__getitems__([(0, 4), (0, 7)]) == first
    assert [i for i, _, _ in first] == [4, 7]        # the dataset gets plain indices
    assert first[0][1:] != first[1][1:]              # samples of a batch still differ
    assert fetch.__getitems__([(1, 4), (1, 7)]) != first              # another epoch
    assert SeededFetch(Draws(), seed=6).__getitems__([(0, 4), (0, 7)]) != first   # another task seed


def test_seeded_fetch_reads_through_and_survives_pickling():
    fetch = SeededFetch(Draws(), seed=5)
    assert len(fetch) == 10 and fetch[3][0] == 3 and fetch.classes == ["a", "b"]
    back = pickle.loads(pickle.dumps(fetch))        # a spawn or forkserver worker gets a copy
    assert back.__getitems__([(0, 1)]) == fetch.__getitems__([(0, 1)])


def test_a_generator_that_runs_out_before_max_steps_is_one_line_saying_so():
    feed = Feed((i for i in range(3)), torch.device("cpu"), accumulate=1)
    assert [feed.next() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(UserError, match=r"^run.steps: the iterator it was given \(a generator\) ran out after 3 "
                                        r"batch\(es\) and cannot start again: give run.steps an iterable that starts "
                                        r"again at each epoch"):
        feed.next()
    again = Feed([0, 1], torch.device("cpu"), accumulate=1)   # a list starts again: epoch after epoch
    assert [again.next() for _ in range(5)] == [0, 1, 0, 1, 0] and again.epoch == 2
    with pytest.raises(UserError, match="the loader gives no batch \\(it is empty"):
        Feed([], torch.device("cpu"), accumulate=1).next()

