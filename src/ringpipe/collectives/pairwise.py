"""The sum of two ranks' tensors by one exchange, non-blocking: the shortest allreduce there is.

With two ranks an allreduce is a swap and an add: each rank posts its vector to the other, and
once both messages have arrived adds what it received to its own. Both ranks then hold
``a + b``, bitwise equal (IEEE addition commutes; half-precision sums are rounded once from
the exact sum, as the backend's widened sum rounds them). It is one message each way where a
ring needs two steps, and it goes straight to the transport from the posting thread, without
the backend's collective worker thread in between.

Why it exists: on gloo over loopback, two ranks, a 2-vCPU host (``benchmarks/pairwise_exchange.py``,
figures in ``benchmarks/RESULTS.md``), gloo's own allreduce took 2.7-3.5x as long as this exchange
from 4 KiB to 512 KiB (e.g. 398 against 123 us at 64 KiB); from 4 MiB gloo's was faster.
:mod:`ringpipe.dp` uses it for the messages of a data-parallel step that are that small
(:func:`ringpipe.dp.transport.isum`).

The caller owns the ordering: exchanges on one communicator and tag are matched in the order
they are posted, so every rank must post them in the same order (the data-parallel engine
posts from one task at a time, in the order the ranks agreed on).
"""

from __future__ import annotations

import threading

import torch

from ringpipe.comm.base import Communicator, Work, nbytes_of

__all__ = ["ANNOUNCE_TAG", "DATA_TAG", "DTYPES", "iallreduce_pair"]

#: Tags of the exchanges: the data-parallel announcements and the gradient data apart, so that
#: an announcement never matches a bucket posted before it.
ANNOUNCE_TAG = 7_200_000
DATA_TAG = 7_200_001
#: The dtypes summed here (the sum of two finite floats is the same on both ranks).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def iallreduce_pair(comm: Communicator, tensor: torch.Tensor, tag: int = DATA_TAG) -> Work:
    """Start summing contiguous ``tensor`` in place with the other rank of a two-rank ``comm``.

    Returns a :class:`~ringpipe.comm.base.Work`: ``wait()`` (or an ``is_completed()`` that
    finds both messages done) adds the peer's vector and returns ``tensor``. The tensor must
    not be changed until then. Recorded in the communication log as one ``allreduce``.
    """
    if comm.size != 2:
        raise ValueError(f"iallreduce_pair needs a communicator of 2 ranks, {comm.name} has {comm.size}")
    if tensor.dtype not in DTYPES or not tensor.is_contiguous():
        raise ValueError(f"iallreduce_pair sums contiguous {', '.join(map(str, DTYPES))} tensors, "
                         f"not a {'non-contiguous ' if not tensor.is_contiguous() else ''}{tensor.dtype} one")
    peer = 1 - comm.rank

    def start() -> Work:
        theirs = torch.empty_like(tensor)
        send = comm._isend(tensor, peer, tag)
        recv = comm._irecv(theirs, peer, tag)
        lock = threading.Lock()
        added = [False]

        def add() -> None:
            with lock:  # once; a second thread finding it complete waits here until the sum is whole
                if not added[0]:
                    tensor.add_(theirs)
                    added[0] = True

        def wait() -> None:
            recv.wait()
            send.wait()
            add()

        def test() -> bool:
            if recv.is_completed() and send.is_completed():
                add()
                return True
            return False

        return Work(wait, test, result=tensor)

    return comm._traced_async("allreduce", nbytes_of(tensor), -1, tag, start)
