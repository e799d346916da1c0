"""Recursive doubling allreduce: ``ceil(lg p)`` exchanges of the whole vector, for small messages.

Cost ``lg p (alpha + n beta + n gamma)`` (ALGORITHMS.md §2): fewest latencies, most bytes.
Sizes that are not powers of two fold the first ``2 rem`` ranks in pairs before and after.
Small messages (header + payload <= :data:`EAGER_BYTES`) carry the consistency header in the
same message as the data, so checking them costs no extra message.
"""

from __future__ import annotations

import time

import torch

from ringpipe.check.doubling_exchange import EAGER_BYTES, HEADER_BYTES, HEADER_TAG, HeaderState
from ringpipe.collectives.common import (
    Ctx,
    doubling_steps,
    exchange,
    exchange_headers,
    header_message,
    header_state,
    reduce_into,
    settle,
)

__all__ = ["allreduce"]


def allreduce(ctx: Ctx, x: torch.Tensor) -> None:
    """Allreduce the flat tensor ``x`` in place (ctx.op; AVERAGE is summed here)."""
    nbytes = x.numel() * x.element_size()
    if ctx.check and HEADER_BYTES + nbytes <= EAGER_BYTES:
        _eager(ctx, x)
        return
    if ctx.check:
        exchange_headers(ctx)
    _plain(ctx, x)


def _plain(ctx: Ctx, x: torch.Tensor) -> None:
    nb = x.numel() * x.element_size()
    spare = ctx.scratch("rd", nb)[:nb].view(x.dtype)
    cur, other = x, spare
    for kind, peer, step in doubling_steps(ctx.comm.rank, ctx.comm.size):
        if kind in ("send", "send_result"):
            exchange(ctx, peer, cur, None, None, step=step)
        elif kind == "recv_result":
            exchange(ctx, None, None, peer, x, step=step)
            cur = x
        else:  # recv or exchange: the partner's vector lands in `other`, reduced with ours there
            exchange(ctx, peer if kind == "exchange" else None, cur, peer, other, operand=cur, step=step)
            cur, other = other, cur
    if cur is not x:
        x.copy_(cur)


def _outgoing(ctx: Ctx, hs: HeaderState, sendbuf: torch.Tensor) -> torch.Tensor:
    """Header + payload; once an invalid call is known, the header and its error text instead."""
    if hs.invalid is not None:
        return header_message(ctx, hs)
    hs.write(sendbuf)
    return sendbuf


def _eager(ctx: Ctx, x: torch.Tensor) -> None:
    comm = ctx.comm
    nb = x.numel() * x.element_size()
    size = HEADER_BYTES + nb
    hs = header_state(ctx)
    sendbuf = ctx.scratch("rd_eager_send", size)[:size]
    recvbuf = ctx.scratch("rd_eager_recv", EAGER_BYTES)[:EAGER_BYTES]
    mine = sendbuf[HEADER_BYTES:].view(x.dtype)
    theirs = recvbuf[HEADER_BYTES:size].view(x.dtype)
    mine.copy_(x)
    assert ctx.op is not None
    for kind, peer, step in doubling_steps(comm.rank, comm.size):
        posted = time.perf_counter_ns()
        if kind in ("send", "send_result"):
            msg = _outgoing(ctx, hs, sendbuf)
            comm.isend(msg, peer, HEADER_TAG).wait()
            ctx.record(step, peer, msg.numel(), posted, time.perf_counter_ns())
            continue
        send = None
        if kind == "exchange":
            send = comm.isend(_outgoing(ctx, hs, sendbuf), peer, HEADER_TAG)
        comm.irecv(recvbuf, peer, HEADER_TAG).wait()
        if send is not None:
            send.wait()
        done = time.perf_counter_ns()
        if hs.absorb(recvbuf, peer):
            if kind == "recv_result":
                mine.copy_(theirs)
            else:
                reduce_into(ctx.op, mine, theirs)
        ctx.record(step, peer, size, posted, done, time.perf_counter_ns() - done)
    settle(ctx, hs)
    x.copy_(mine)
