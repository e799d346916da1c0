"""Ring allreduce, reduce-scatter and allgather (baidu-allreduce's segmentation, pipelined).

The vector is cut into ``p`` blocks (the first ``n % p`` one element longer, so any length
works, including 0 and lengths below ``p``). Reduce-scatter: at step ``s`` rank ``r`` sends
block ``r-s-1`` to ``r+1`` and receives block ``r-s-2`` from ``r-1``, reducing it; after
``p-1`` steps it holds the reduced block ``r``. Allgather then circulates the reduced blocks
for ``p-1`` more steps. Cost ``2(p-1) alpha + 2((p-1)/p) n beta + ((p-1)/p) n gamma``.

Blocks travel as chunks: each chunk is forwarded to the next rank as soon as it has been
received (and reduced), and the receives of the next step are posted before the current one
is processed, so reducing, receiving and sending overlap as in gloo's own segmented ring.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ringpipe.collectives.common import Ctx, reduce3, reduce_into, segments
from ringpipe.comm.base import Work

__all__ = ["allreduce", "reduce_scatter", "allgather"]

View = Callable[[int, int, int, int], torch.Tensor]  # (step, block, offset, length) -> 1-D view


def _stream(
    ctx: Ctx,
    steps: int,
    blocks: list[tuple[int, int]],
    itemsize: int,
    sblock: Callable[[int], int],
    rblock: Callable[[int], int],
    src: View,
    dst: View,
    after: Callable[[int, int, int, int], None] | None,
) -> None:
    """Run ``steps`` ring steps; step ``s+1`` sends block ``rblock(s)`` chunk by chunk."""
    comm = ctx.comm
    p, r = comm.size, comm.rank
    succ, pred = (r + 1) % p, (r - 1) % p
    base = ctx.step
    ctx.step += steps
    chunks = [[(off + o, ln) for o, ln in ctx.chunks(length, itemsize)] for off, length in blocks]
    in_flight: dict[int, list[Work]] = {}  # block -> sends still reading it

    def post_recvs(s: int) -> list[tuple[Work, int, int, int]]:
        k = rblock(s)
        for w in in_flight.pop(k, []):
            w.wait()  # never receive into memory that is still being sent
        tag_s = base + s
        return [(comm.irecv(dst(s, k, off, ln), pred, ctx.tag(tag_s, j)), j, off, ln)
                for j, (off, ln) in enumerate(chunks[k])]

    k0 = sblock(0)
    in_flight[k0] = [comm.isend(src(0, k0, off, ln), succ, ctx.tag(base, j))
                     for j, (off, ln) in enumerate(chunks[k0])]
    posted = time.perf_counter_ns()
    pending = post_recvs(0)
    for s in range(steps):
        last = s + 1 == steps
        nxt = [] if last else post_recvs(s + 1)
        next_posted = time.perf_counter_ns()
        k = rblock(s)
        forwarded: list[Work] = []
        reduce_ns = 0
        for work, j, off, ln in pending:
            work.wait()
            if after is not None:
                t = time.perf_counter_ns()
                after(s, k, off, ln)
                reduce_ns += time.perf_counter_ns() - t
            if not last:
                forwarded.append(comm.isend(src(s + 1, k, off, ln), succ, ctx.tag(base + s + 1, j)))
        ctx.record(base + s, pred, blocks[k][1] * itemsize, posted, time.perf_counter_ns(), reduce_ns)
        if forwarded:
            in_flight.setdefault(k, []).extend(forwarded)
        pending, posted = nxt, next_posted
    for works in in_flight.values():
        for w in works:
            w.wait()


def allreduce(ctx: Ctx, x: torch.Tensor) -> None:
    """Allreduce the flat tensor ``x`` in place."""
    p, r = ctx.comm.size, ctx.comm.rank
    blocks = segments(x.numel(), p)
    op = ctx.op
    assert op is not None
    longest = max(ln for _, ln in blocks) * x.element_size()
    bufs = [ctx.scratch(f"ring{i}", longest)[:longest].view(x.dtype) for i in (0, 1)]

    def sblock(s: int) -> int:
        return (r - s - 1) % p if s < p - 1 else (r - (s - p + 1)) % p

    def rblock(s: int) -> int:
        return (r - s - 2) % p if s < p - 1 else (r - (s - p + 1) - 1) % p

    def src(s: int, k: int, off: int, ln: int) -> torch.Tensor:
        return x[off:off + ln]

    def dst(s: int, k: int, off: int, ln: int) -> torch.Tensor:
        if s >= p - 1:
            return x[off:off + ln]
        rel = off - blocks[k][0]
        return bufs[s % 2][rel:rel + ln]

    def after(s: int, k: int, off: int, ln: int) -> None:
        if s < p - 1:
            rel = off - blocks[k][0]
            reduce_into(op, x[off:off + ln], bufs[s % 2][rel:rel + ln])

    _stream(ctx, 2 * (p - 1), blocks, x.element_size(), sblock, rblock, src, dst, after)


def reduce_scatter(ctx: Ctx, x: torch.Tensor, out: torch.Tensor) -> None:
    """Reduce the flat ``x`` (``p`` equal blocks) and write block ``rank`` into ``out``; ``x`` is kept."""
    p, r = ctx.comm.size, ctx.comm.rank
    blocks = segments(x.numel(), p)
    op = ctx.op
    assert op is not None
    nb = x.numel() * x.element_size()
    work = ctx.scratch("rs_work", nb)[:nb].view(x.dtype)
    longest = max(ln for _, ln in blocks) * x.element_size()
    bufs = [ctx.scratch(f"ring{i}", longest)[:longest].view(x.dtype) for i in (0, 1)]

    def src(s: int, k: int, off: int, ln: int) -> torch.Tensor:
        return (x if s == 0 else work)[off:off + ln]

    def dst(s: int, k: int, off: int, ln: int) -> torch.Tensor:
        rel = off - blocks[k][0]
        return bufs[s % 2][rel:rel + ln]

    def after(s: int, k: int, off: int, ln: int) -> None:
        rel = off - blocks[k][0]
        target = out[rel:rel + ln] if s == p - 2 else work[off:off + ln]
        reduce3(op, target, x[off:off + ln], bufs[s % 2][rel:rel + ln])

    _stream(ctx, p - 1, blocks, x.element_size(), lambda s: (r - s - 1) % p,
            lambda s: (r - s - 2) % p, src, dst, after)


def allgather(ctx: Ctx, x: torch.Tensor, out: torch.Tensor) -> None:
    """Gather every rank's flat ``x`` into ``out`` (``p`` blocks of ``x.numel()``)."""
    p, r = ctx.comm.size, ctx.comm.rank
    n = x.numel()
    blocks = [(i * n, n) for i in range(p)]
    out[r * n:(r + 1) * n].copy_(x)

    def view(s: int, k: int, off: int, ln: int) -> torch.Tensor:
        return out[off:off + ln]

    _stream(ctx, p - 1, blocks, x.element_size(), lambda s: (r - s) % p,
            lambda s: (r - s - 1) % p, view, view, None)
