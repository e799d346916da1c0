"""Plumbing shared by the algorithms: the per-call context, segments, reductions and chunked exchanges.

Every algorithm runs over ``comm.isend`` / ``comm.irecv`` only. Sends and receives of a step
are posted together; a large message is cut into chunks (:data:`CHUNK_BYTES`) so that the
reduction of one chunk overlaps the arrival of the next. Each step is recorded in
``comm.log`` as an event ``<collective>.step`` with the collective's number, the step, the
peer, the bytes, when it was posted, when it completed and how long reducing took.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ringpipe.check import doubling_exchange
from ringpipe.check.call import CallInfo
from ringpipe.check.doubling_exchange import (
    HEADER_BYTES,
    TEXT_BYTES,
    HeaderState,
    home_device,
    scratch,
)
from ringpipe.comm.base import Communicator, ReduceOp, Work
from ringpipe.comm.doubling import doubling_steps, new_rank, real_rank

__all__ = [
    "CHUNK_BYTES",
    "Ctx",
    "segments",
    "reduce_into",
    "reduce3",
    "new_rank",
    "real_rank",
    "finish_average",
    "doubling_steps",
    "exchange",
    "exchange_headers",
    "header_message",
    "header_state",
    "home_device",
    "settle",
]

#: Chunk size of pipelined messages (gloo's own ring uses segments of up to 1 MiB).
CHUNK_BYTES = 512 * 1024
#: At most this many chunks per message: larger messages get larger chunks. Every chunk is a
#: Python-level isend/irecv pair (tens of microseconds each); with 64 chunks of 512 KiB a 64 MiB
#: ring allreduce ran at 0.86-0.93x native gloo on 2 and 4 ranks, with 8 chunks at 1.04-1.05x
#: (benchmarks/RESULTS.md).
MAX_CHUNKS = 8
DATA_TAG = 7100


def segments(n: int, parts: int) -> list[tuple[int, int]]:
    """baidu-allreduce's split: ``parts`` (offset, length) pairs, the first ``n % parts`` one longer."""
    base, extra = divmod(n, parts)
    out, off = [], 0
    for i in range(parts):
        ln = base + (1 if i < extra else 0)
        out.append((off, ln))
        off += ln
    return out


def reduce_into(op: ReduceOp, acc: torch.Tensor, other: torch.Tensor) -> None:
    """``acc = acc (op) other`` in place (AVERAGE sums; the division comes at the end)."""
    if op is ReduceOp.SUM or op is ReduceOp.AVERAGE:
        torch.add(acc, other, out=acc)
    elif op is ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    elif op is ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    else:
        torch.mul(acc, other, out=acc)


def reduce3(op: ReduceOp, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a (op) b`` without touching ``a`` or ``b``."""
    if op is ReduceOp.SUM or op is ReduceOp.AVERAGE:
        torch.add(a, b, out=out)
    elif op is ReduceOp.MAX:
        torch.maximum(a, b, out=out)
    elif op is ReduceOp.MIN:
        torch.minimum(a, b, out=out)
    else:
        torch.mul(a, b, out=out)


def finish_average(tensor: torch.Tensor, op: ReduceOp | None, size: int) -> None:
    """Divide by the number of ranks for AVERAGE (integers floor, as the native path does)."""
    if op is ReduceOp.AVERAGE and size > 1:
        if tensor.is_floating_point():
            tensor.div_(size)
        else:
            torch.div(tensor, size, rounding_mode="floor", out=tensor)


class Ctx:
    """One collective call on one rank: who, what, and how to trace its steps."""

    __slots__ = ("comm", "coll", "seq", "op", "algo", "check", "call", "device", "chunk_bytes", "step", "desc")

    def __init__(self, comm: Communicator, coll: str, seq: int, op: ReduceOp | None, algo: str,
                 check: bool, call: CallInfo, device: torch.device,
                 desc: dict[str, Any] | None = None) -> None:
        self.comm = comm
        self.coll = coll
        self.seq = seq
        self.op = op
        self.algo = algo
        self.check = check
        self.call = call
        self.device = device
        self.chunk_bytes = CHUNK_BYTES
        self.step = 0
        #: The call as every rank's error lists it when calls differ.
        self.desc = desc if desc is not None else {"collective": coll, "seq": seq}

    def scratch(self, name: str, nbytes: int) -> torch.Tensor:
        return scratch(self.comm, name, nbytes, self.device)

    def chunks(self, length: int, itemsize: int) -> list[tuple[int, int]]:
        """Chunk bounds of a message of ``length`` elements (the same rule on both sides)."""
        if length == 0:
            return []
        n = min(MAX_CHUNKS, max(1, math.ceil(length * itemsize / self.chunk_bytes)))
        return [c for c in segments(length, n) if c[1]]

    @staticmethod
    def tag(step: int, chunk: int) -> int:
        return DATA_TAG + (step % 2) * MAX_CHUNKS + chunk

    def record(self, step: int, peer: int, nbytes: int, posted_ns: int, done_ns: int,
               reduce_ns: int = 0) -> None:
        self.comm.log.record(
            f"{self.coll}.step", nbytes, peer, posted_ns, done_ns, 0, self.comm.name,
            collective=self.coll, cid=self.seq, step=step, algorithm=self.algo, reduce_ns=reduce_ns,
        )


def header_state(ctx: Ctx, invalid: str | None = None) -> HeaderState:
    """This rank's header; ``invalid``: the error text of a call this rank cannot run."""
    hs = HeaderState(ctx.comm.rank, ctx.call)
    if invalid is not None:
        hs.invalid = (ctx.comm.rank, invalid)
    return hs


def header_message(ctx: Ctx, hs: HeaderState) -> torch.Tensor:
    """The header-only message of ``hs`` (with the error text of an invalid call, if known)."""
    send = ctx.scratch("hdr_send", HEADER_BYTES + TEXT_BYTES)
    return send[:hs.write(send)]


def exchange_headers(ctx: Ctx, invalid: str | None = None) -> None:
    """Header-only recursive doubling; raises on every rank if calls differ or one is invalid.

    :class:`MismatchError` when calls differ; :class:`InvalidCallError` when some rank passes
    ``invalid`` (its error text: that rank cannot run its call but still takes part here, so
    that no peer waits for it forever).
    """
    doubling_exchange.exchange_headers(ctx.comm, ctx.call, ctx.desc, invalid, ctx.algo)


def settle(ctx: Ctx, hs: HeaderState) -> None:
    """Raise the same error on every rank if the exchange of ``hs`` found a difference."""
    doubling_exchange.settle(ctx.comm, hs, ctx.desc)


def exchange(
    ctx: Ctx,
    send_peer: int | None,
    send_view: torch.Tensor | None,
    recv_peer: int | None,
    recv_view: torch.Tensor | None,
    target: torch.Tensor | None = None,
    operand: torch.Tensor | None = None,
    step: int | None = None,
) -> None:
    """One step: send ``send_view`` and receive into ``recv_view`` chunk by chunk, together.

    Each received chunk is reduced as soon as it arrives, while the next chunks are still on
    the wire: into ``target`` (``target op= received``) or, with ``operand``, into the receive
    buffer itself (``received op= operand``). Views are 1-D and of equal lengths. ``step``
    (by default the next of ``ctx``) must be the same on the sending and the receiving rank:
    it selects the message tags.
    """
    comm = ctx.comm
    if step is None:
        step = ctx.step
        ctx.step += 1
    posted = time.perf_counter_ns()
    recvs: list[tuple[Work, int, int]] = []
    if recv_view is not None and recv_peer is not None:
        for j, (off, ln) in enumerate(ctx.chunks(recv_view.numel(), recv_view.element_size())):
            recvs.append((comm.irecv(recv_view[off:off + ln], recv_peer, ctx.tag(step, j)), off, ln))
    sends: list[Work] = []
    if send_view is not None and send_peer is not None:
        for j, (off, ln) in enumerate(ctx.chunks(send_view.numel(), send_view.element_size())):
            sends.append(comm.isend(send_view[off:off + ln], send_peer, ctx.tag(step, j)))
    reduce_ns = 0
    for work, off, ln in recvs:
        work.wait()
        if target is not None or operand is not None:
            t = time.perf_counter_ns()
            assert ctx.op is not None and recv_view is not None
            if target is not None:
                reduce_into(ctx.op, target[off:off + ln], recv_view[off:off + ln])
            else:
                assert operand is not None
                reduce_into(ctx.op, recv_view[off:off + ln], operand[off:off + ln])
            reduce_ns += time.perf_counter_ns() - t
    done = time.perf_counter_ns()
    for s in sends:
        s.wait()
    if recv_view is not None and recv_peer is not None:
        ctx.record(step, recv_peer, recv_view.numel() * recv_view.element_size(), posted, done, reduce_ns)
    if send_view is not None and send_peer is not None:
        ctx.record(step, send_peer, send_view.numel() * send_view.element_size(), posted,
                   time.perf_counter_ns())
