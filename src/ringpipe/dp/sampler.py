"""Data sharding: torch's DistributedSampler with ringpipe's rank and size."""

from __future__ import annotations

from typing import Any

import torch.utils.data

from ringpipe.comm.base import Communicator

__all__ = ["DistributedSampler"]


class DistributedSampler(torch.utils.data.DistributedSampler):
    """``torch.utils.data.DistributedSampler`` whose replicas and rank come from ringpipe.

    Every sample is seen once per epoch across ranks (with ``drop_last=False`` a few samples
    are repeated to even the shards; with ``drop_last=True`` the tail is dropped). Call
    ``set_epoch(epoch)`` every epoch for a fresh shuffle.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        comm: Communicator | None = None,
    ) -> None:
        if num_replicas is None or rank is None:
            if comm is None:
                from ringpipe.core.world import current

                comm = current().comm
            num_replicas = comm.size if num_replicas is None else num_replicas
            rank = comm.rank if rank is None else rank
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
