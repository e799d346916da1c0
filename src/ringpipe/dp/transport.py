"""How the data-parallel path moves a sum: the backend's allreduce, or one pairwise exchange.

Every sum the data-parallel API posts (the announcements, the optimizer's buckets, the
announced allreduces, and a joined rank's zeros standing in for any of them) goes through
:func:`isum`, so that the ranks with data and a joined rank always pick the same transport for
a message: the choice depends only on what every rank of the call shares (backend, number of
ranks, dtype, device and length).

On two gloo ranks, floating-point messages up to :data:`PAIRWISE_BYTES` go as one exchange of
point-to-point messages (:func:`ringpipe.collectives.pairwise.iallreduce_pair`): gloo's
allreduce took 2.7-3.5x as long from 4 KiB to 512 KiB, about as long at 768 KiB - 1 MiB, and
the exchange was slower from 4 MiB (0.84x at 4 MiB, 0.59x at 16 MiB; loopback, 2-vCPU host,
``benchmarks/pairwise_exchange.py``, figures in ``benchmarks/RESULTS.md``). Everything else
takes the backend's allreduce.
"""

from __future__ import annotations

import torch

from ringpipe.collectives.pairwise import ANNOUNCE_TAG, DATA_TAG, DTYPES, iallreduce_pair
from ringpipe.comm.base import Communicator, ReduceOp, Work, nbytes_of

__all__ = ["ANNOUNCE_TAG", "DATA_TAG", "PAIRWISE_BYTES", "isum", "pairwise"]

#: The largest message (bytes) exchanged pairwise on two gloo ranks.
PAIRWISE_BYTES = 512 * 1024


def pairwise(comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> bool:
    """Whether :func:`isum` exchanges ``tensor`` pairwise on ``comm`` (the same answer on every rank)."""
    return (
        comm.size == 2
        and comm.backend == "gloo"
        and op in (ReduceOp.SUM, ReduceOp.AVERAGE)
        and tensor.dtype in DTYPES
        and tensor.device.type == "cpu"
        and 0 < nbytes_of(tensor) <= PAIRWISE_BYTES
    )


def isum(comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, tag: int = DATA_TAG) -> Work:
    """Start reducing ``tensor`` in place (Sum, or the Average of floating-point tensors too); a Work.

    ``tag`` keeps the announcements' exchanges apart from the data's (:data:`ANNOUNCE_TAG`).
    """
    if not pairwise(comm, tensor, op):
        return comm.iallreduce(tensor, op)
    # (contiguity is this rank's own affair, so it does not decide the transport: a strided tensor is exchanged as a copy)
    flat = tensor if tensor.is_contiguous() else tensor.contiguous()
    work = iallreduce_pair(comm, flat, tag)
    if op is not ReduceOp.AVERAGE and flat is tensor:
        return work

    def finish() -> None:
        if op is ReduceOp.AVERAGE:
            flat.div_(comm.size)
        if flat is not tensor:
            tensor.copy_(flat)

    return Work(work.wait, work.is_completed, result=tensor, post=finish)
