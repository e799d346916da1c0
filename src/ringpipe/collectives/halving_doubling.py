"""Rabenseifner's allreduce: reduce-scatter by recursive halving, allgather by recursive doubling.

Cost ``2 lg p alpha + 2((p-1)/p) n beta + ((p-1)/p) n gamma`` (ALGORITHMS.md §2): the ring's
bandwidth with ``lg p`` instead of ``p`` latencies. For sizes that are not powers of two the
first ``2 rem`` ranks fold in pairs (the even rank hands its vector to the odd one and gets
the result back at the end), leaving ``p2 = 2^floor(lg p)`` ranks for the core.
"""

from __future__ import annotations

import torch

from ringpipe.collectives.common import Ctx, doubling_steps, exchange, new_rank, real_rank, segments

__all__ = ["allreduce"]


def allreduce(ctx: Ctx, x: torch.Tensor) -> None:
    """Allreduce the flat tensor ``x`` in place."""
    comm = ctx.comm
    p = comm.size
    n = x.numel()
    plan = doubling_steps(comm.rank, p)
    nb = n * x.element_size()
    buf = ctx.scratch("rab", nb)[:nb].view(x.dtype)
    me = new_rank(comm.rank, p)
    p2 = 1 << (p.bit_length() - 1)
    last = 2 + 2 * (p2.bit_length() - 1)  # the step of the fold's return message
    if me is None:  # folded: hand the vector over, get the result back
        exchange(ctx, plan[0][1], x, None, None, step=0)
        exchange(ctx, None, None, plan[1][1], x, step=last)
        return
    if plan[0][0] == "recv":
        exchange(ctx, None, None, plan[0][1], buf, target=x, step=0)
    step = 2
    bounds = segments(n, p2)

    def span(lo: int, hi: int) -> tuple[int, int]:
        start = bounds[lo][0]
        end = bounds[hi - 1][0] + bounds[hi - 1][1]
        return start, end

    lo, hi = 0, p2
    dist = p2 // 2
    while dist >= 1:  # recursive halving: keep half, send the other half, reduce what comes back
        peer = real_rank(me ^ dist, p)
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if me & dist else ((lo, mid), (mid, hi))
        ks, ke = span(*keep)
        gs, ge = span(*give)
        exchange(ctx, peer, x[gs:ge], peer, buf[:ke - ks], target=x[ks:ke], step=step)
        step += 1
        lo, hi = keep
        dist //= 2
    dist = 1
    while dist < p2:  # recursive doubling: swap reduced ranges, doubling them
        partner = me ^ dist
        plo = (partner // dist) * dist
        ms, me_end = span(lo, hi)
        ps, pe = span(plo, plo + dist)
        peer = real_rank(partner, p)
        exchange(ctx, peer, x[ms:me_end], peer, x[ps:pe], step=step)
        step += 1
        lo, hi = min(lo, plo), min(lo, plo) + 2 * dist
        dist *= 2
    if plan[-1][0] == "send_result":
        assert step == last
        exchange(ctx, plan[-1][1], x, None, None, step=last)
