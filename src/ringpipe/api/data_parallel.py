"""The torch face's Horovod calls over ``ringpipe.dp``'s features: ``join`` and ``broadcast_optimizer_state``."""

from __future__ import annotations

from typing import Any

import torch

from ringpipe.core.process_sets import ProcessSet, global_process_set
from ringpipe.dp import broadcast as _broadcast
from ringpipe.dp.join import join_process_set

__all__ = ["broadcast_optimizer_state", "join"]


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Wait for every rank to run out of data; returns the last rank to join.

    Meanwhile this rank serves the others' optimizer steps (with their learning rate), their
    allreduces (SyncBatchNorm, metrics: it contributes zeros, and an Average still divides by
    the full size, as in Horovod) and barriers; any other collective raises on the rank that
    called it while the joined rank goes on. ``device`` is accepted for Horovod compatibility.
    """
    return join_process_set(process_set)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """``root_rank``'s optimizer state on every rank of the set, Horovod's way.

    As in Horovod, an optimizer without state yet first takes one local step on zero gradients
    so that its state is complete (Adam's step count then starts at 1; weight decay moves the
    weights).
    """
    _broadcast.broadcast_optimizer_state(optimizer, root_rank, process_set=process_set, model=model,
                                         initialize_state=True)
