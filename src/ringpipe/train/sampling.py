"""The batch stream of one data-parallel replica: shuffled shards, pass after pass, resumable.

Each pass over the data is ``torch.utils.data.DistributedSampler``'s shard for this replica
(the same permutation on every replica for a given seed and pass, every sample once across
replicas). Batches are cut from the concatenation of passes, so every step has exactly
``batch_size`` samples per replica and the epoch ``step * global_batch / records`` is exact.
The position (pass, offset) is the whole state: a resumed run continues mid-pass.

A pass may also begin at position ``start`` of its permutation (a run resumed on another
number of replicas, see :mod:`ringpipe.train.checkpoints.resize`): the rest of the permutation is then
padded and dealt out by DistributedSampler's rule (padding repeats its first samples).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ShardStream", "eval_indices", "SplitTooSmall", "check_split_sizes"]


class SplitTooSmall(ValueError):
    """A split has too few samples for the run's replicas; raised alike on every rank, before training."""


def check_split_sizes(train: int, replicas: int, data: str) -> None:
    """Refuse a train set with fewer samples than replicas (each replica needs one of its own).

    A test set may be smaller than the replicas (a replica with no test sample evaluates nothing,
    see :func:`eval_indices`) or absent; ``data`` names the data in the message.
    """
    if train < replicas:
        raise SplitTooSmall(
            f"{data}: the train set has {train} sample{'s' if train != 1 else ''}, fewer than the run's {replicas} "
            f"data-parallel replicas (each needs samples of its own): give it at least {replicas} samples, or run "
            f"fewer replicas"
        )


class ShardStream:
    """Index batches for replica ``rank`` of ``replicas`` over ``records`` samples."""

    def __init__(self, records: int, replicas: int, rank: int, batch_size: int, seed: int) -> None:
        self.records, self.replicas, self.rank = records, replicas, rank
        self.batch_size, self.seed = batch_size, seed
        self.pass_ = 0
        self.offset = 0
        self.start = 0  # where this pass's sharding begins in the pass's permutation
        self._shard: torch.Tensor | None = None

    def _current(self) -> torch.Tensor:
        if self._shard is None:
            if self.start == 0:
                self._shard = torch.tensor(list(self._sampler(self.replicas, self.rank)), dtype=torch.long)
            else:
                rest = torch.tensor(list(self._sampler(1, 0)), dtype=torch.long)[self.start :]
                size = math.ceil(len(rest) / self.replicas) * self.replicas
                padded = rest.repeat(math.ceil(size / len(rest)))[:size]  # DistributedSampler's padding
                self._shard = padded[self.rank :: self.replicas]
        return self._shard

    def _sampler(self, replicas: int, rank: int) -> DistributedSampler[int]:
        # DistributedSampler only takes len() of its dataset; with one replica: the pass's permutation.
        sampler: DistributedSampler[int] = DistributedSampler(
            range(self.records),  # type: ignore[arg-type]
            num_replicas=replicas,
            rank=rank,
            shuffle=True,
            seed=self.seed,
        )
        sampler.set_epoch(self.pass_)
        return sampler

    def next_batch(self) -> torch.Tensor:
        parts, need = [], self.batch_size
        while need:
            shard = self._current()
            take = shard[self.offset : self.offset + need]
            parts.append(take)
            need -= len(take)
            self.offset += len(take)
            if self.offset >= len(shard):
                self.pass_, self.offset, self.start, self._shard = self.pass_ + 1, 0, 0, None
        return torch.cat(parts)

    def state_dict(self) -> dict[str, Any]:
        return {"pass": self.pass_, "offset": self.offset, "start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pass_, self.offset, self._shard = int(state["pass"]), int(state["offset"]), None
        self.start = int(state.get("start", 0))


def eval_indices(records: int, replicas: int, rank: int, batch_size: int) -> list[torch.Tensor]:
    """This replica's evaluation batches: samples ``rank, rank + replicas, ...`` (each sample once overall;
    none for a replica whose rank is past the last sample)."""
    mine = torch.arange(rank, max(rank, records), replicas)
    return list(mine.split(batch_size)) if len(mine) else []
