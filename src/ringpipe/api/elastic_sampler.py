"""Horovod's ``hvd.elastic.ElasticSampler``: a distributed sampler that re-splits what is left of an epoch after a reset.

Like ``torch.utils.data.DistributedSampler``, each rank draws every ``size()``-th index of one
order of the dataset, padded by wrapping around so that every rank gets as many. Unlike it, the
sampler counts what the job has processed (``record_batch(batch_idx, batch_size)`` adds
``batch_size * size()``), and rebuilds its split from the ranks of the moment whenever it is
reset: tracked by :class:`~ringpipe.api.elastic.TorchState`, a rank that joins or leaves makes
the remaining indices of the epoch be divided among the new set of ranks, none processed twice.

The order is Horovod's (``horovod/torch/elastic/sampler.py``), so a program sees the same indices
on ringpipe: ``range(len(dataset))``, shuffled in place by ``random.Random(seed + epoch)`` when
``shuffle``; the first ``processed_num`` of them are skipped. Call ``set_epoch(epoch)`` at the
*end* of an epoch (it clears the count), and keep the dataset's length constant.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from ringpipe.core.basics import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Indices of this rank's share of what is left of the epoch; re-split on every :meth:`reset`."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()  # Horovod's attribute, kept for programs that read it
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (its own order when shuffling) with nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Split the epoch's unprocessed indices among the ranks of the current world."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:  # wrap around until every rank gets num_samples
            padded += padded[: self.total_size - len(padded)]
        self.indices = padded[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
