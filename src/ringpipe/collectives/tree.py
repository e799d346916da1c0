"""Binomial-tree broadcast and reduce, pipelined by chunks.

Cost ``ceil(lg p)(alpha + n beta)`` for broadcast (ALGORITHMS.md §2). Ranks are renumbered
relative to the root; rank ``v`` receives from ``v - lowbit(v)`` and serves ``v + 2^k`` for
every ``2^k < lowbit(v)`` (largest subtree first). Each chunk is forwarded (broadcast) or
reduced and passed up (reduce) as soon as it is complete, so deep trees stream.
"""

from __future__ import annotations

import time

import torch

from ringpipe.collectives.common import Ctx, reduce_into
from ringpipe.comm.base import Work

__all__ = ["broadcast", "reduce", "tree_links"]


def tree_links(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """(parent, children) of ``rank`` in the binomial tree rooted at ``root`` (real ranks)."""
    v = (rank - root) % size
    mask = 1
    parent = None
    while mask < size:
        if v & mask:
            parent = v - mask
            break
        mask <<= 1
    children = []
    m = mask >> 1
    while m > 0:
        if v + m < size:
            children.append(v + m)
        m >>= 1
    real = [(c + root) % size for c in children]
    return (None if parent is None else (parent + root) % size), real


def broadcast(ctx: Ctx, x: torch.Tensor, root: int) -> None:
    """Broadcast the flat ``x`` from ``root`` in place."""
    comm = ctx.comm
    parent, children = tree_links(comm.rank, comm.size, root)
    step = ctx.step
    ctx.step += 1
    chunks = ctx.chunks(x.numel(), x.element_size())
    posted = time.perf_counter_ns()
    sends: list[Work] = []
    if parent is None:
        for j, (off, ln) in enumerate(chunks):
            sends += [comm.isend(x[off:off + ln], c, ctx.tag(step, j)) for c in children]
    else:
        recvs = [comm.irecv(x[off:off + ln], parent, ctx.tag(step, j)) for j, (off, ln) in enumerate(chunks)]
        for j, (off, ln) in enumerate(chunks):
            recvs[j].wait()
            sends += [comm.isend(x[off:off + ln], c, ctx.tag(step, j)) for c in children]
        ctx.record(step, parent, x.numel() * x.element_size(), posted, time.perf_counter_ns())
    for w in sends:
        w.wait()
    for c in children:
        ctx.record(step, c, x.numel() * x.element_size(), posted, time.perf_counter_ns())


def reduce(ctx: Ctx, x: torch.Tensor, root: int) -> None:
    """Reduce the flat ``x`` into ``root``'s ``x`` (other ranks' ``x`` hold partial results)."""
    comm = ctx.comm
    op = ctx.op
    assert op is not None
    parent, children = tree_links(comm.rank, comm.size, root)
    step = ctx.step
    ctx.step += 1
    n = x.numel()
    nb = n * x.element_size()
    chunks = ctx.chunks(n, x.element_size())
    bufs = ctx.scratch("tree_reduce", nb * len(children))[:nb * len(children)].view(x.dtype)
    posted = time.perf_counter_ns()
    recvs = [
        [comm.irecv(bufs[i * n + off:i * n + off + ln], c, ctx.tag(step, j)) for j, (off, ln) in enumerate(chunks)]
        for i, c in enumerate(children)
    ]
    sends: list[Work] = []
    reduce_ns = 0
    for j, (off, ln) in enumerate(chunks):
        for i in range(len(children)):
            recvs[i][j].wait()
            t = time.perf_counter_ns()
            reduce_into(op, x[off:off + ln], bufs[i * n + off:i * n + off + ln])
            reduce_ns += time.perf_counter_ns() - t
        if parent is not None:
            sends.append(comm.isend(x[off:off + ln], parent, ctx.tag(step, j)))
    done = time.perf_counter_ns()
    for c in children:
        ctx.record(step, c, nb, posted, done, reduce_ns // max(1, len(children)))
    for w in sends:
        w.wait()
    if parent is not None:
        ctx.record(step, parent, nb, posted, time.perf_counter_ns())
