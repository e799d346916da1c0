"""``hvd.elastic.ElasticSampler`` as Horovod defines it, on real ranks.

Expected indices are written out here from Horovod's documented rule
(``horovod/torch/elastic/sampler.py``): the order is ``range(len(dataset))`` shuffled in place by
``random.Random(seed + epoch)``; the first ``processed_num`` indices are skipped; the rest is
padded by wrapping around to a multiple of the number of ranks, and rank ``r`` takes every
``size``-th index from position ``r``. ``record_batch(i, b)`` counts ``b * size`` samples.
"""

from __future__ import annotations

import random

import torch

import ringpipe as hvd


def _split(n, seed, epoch, processed, ranks, shuffle=True):
    order = list(range(n))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    rest = order[processed:]
    per_rank = -(-len(rest) // ranks)
    padded = (rest * (ranks + 1))[: per_rank * ranks] if rest else []
    return [padded[r::ranks] for r in range(ranks)]


def _sampler(comm):  # noqa: ANN001
    hvd.init(comm)
    try:
        r = hvd.rank()
        data = list(range(10))
        s = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
        out = {"epoch0": list(s), "len": len(s)}
        s.record_batch(0, 2)
        s.record_batch(1, 2)
        s.reset()  # what a TorchState reset does: re-split what is left
        out["after_two_batches"] = list(s)
        s.set_epoch(1)
        out["epoch1"] = list(s)
        out["plain"] = list(hvd.elastic.ElasticSampler(data, shuffle=False))
        # a state saved by a job of another size: the rest of its epoch split among these ranks
        s.load_state_dict({"epoch": 2, "processed_num": 7})
        out["resized"] = list(s)
        # tracked by a TorchState: commit / restore go back, sync takes rank 0's state
        model = torch.nn.Linear(2, 1)
        state = hvd.elastic.TorchState(model=model, sampler=s, epoch=2)
        state.commit()
        s.record_batch(0, 1)
        state.restore()
        out["restored"] = s.state_dict()
        if r == 1:
            s.load_state_dict({"epoch": 5, "processed_num": 3})
        state.sync()
        out["synced"] = [s.state_dict(), list(s)]
        return out
    finally:
        hvd.shutdown()


def test_elastic_sampler_splits_and_resplits_as_horovod(worlds):
    for ranks in (2, 3):
        outs = worlds.spawn(_sampler, ranks)
        for r, out in enumerate(outs):
            assert out["epoch0"] == _split(10, 3, 0, 0, ranks)[r]
            assert out["len"] == -(-10 // ranks)
            assert out["after_two_batches"] == _split(10, 3, 0, 2 * 2 * ranks, ranks)[r]
            assert out["epoch1"] == _split(10, 3, 1, 0, ranks)[r]
            assert out["plain"] == _split(10, 0, 0, 0, ranks, shuffle=False)[r]
            assert out["resized"] == _split(10, 3, 2, 7, ranks)[r]
            assert out["restored"] == {"epoch": 2, "processed_num": 7}
            assert out["synced"] == [{"epoch": 2, "processed_num": 7}, _split(10, 3, 2, 7, ranks)[r]]
        # every index left in the epoch is drawn by some rank
        assert set().union(*(o["after_two_batches"] for o in outs)) == set(_split(10, 3, 0, 4 * ranks, 1)[0])
