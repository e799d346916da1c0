"""Adasum: adaptive summation of gradients by vector halving and distance doubling.

Maleki et al., "Scaling Distributed Training with Adaptive Summation" (MLSys 2021) combine
two gradients ``a`` and ``b`` as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is their sum when they are orthogonal and their average when they are parallel. For
``p = 2^k`` ranks the combination is applied as a tree over rank order: rank pairs
``(0, 1), (2, 3), ...`` first, then the pairs of pairs, and so on, so that with 4 ranks the
result is ``adasum(adasum(g0, g1), adasum(g2, g3))``. Like Horovod's CPU implementation,
the tree runs as vector halving, distance doubling: at level ``d = 1, 2, 4, ...`` rank ``r``
swaps half of its current segment with rank ``r ^ d`` (the rank whose bit ``d`` is clear keeps
the first half, the first half having ``floor(len / 2)`` elements), computes the dot product
and both squared norms on the half it kept, sums them over the ``2d`` ranks that hold a piece
of the two vectors being combined, and combines its half; the halves are then gathered back
by distance halving.

As in Horovod: dot products and norms are accumulated in float64 for float16, float32 and
float64 tensors (no other dtype); a vector whose squared norm is below ``sqrt(DBL_MIN)`` gets
the coefficient 1 (so a zero gradient leaves the other one unchanged instead of dividing by
zero); several tensors reduced in one call are carried in one buffer but each gets its own
dot products and coefficients, exactly as if reduced one by one; and the number of ranks must
be a power of two (anything else raises Horovod's ``NotImplementedError`` on every rank).
Every message is a ``comm.isend`` / ``comm.irecv`` pair, so any communicator serves.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import overload

import torch

from ringpipe.check.call import CallInfo, MismatchError, dtype_name, invalid_message
from ringpipe.check.doubling_exchange import next_seq
from ringpipe.collectives.common import Ctx, exchange, exchange_headers, home_device
from ringpipe.comm.base import CommError, Communicator, ReduceOp

__all__ = ["adasum_allreduce", "ADASUM_DTYPES", "SQRT_DBL_MIN"]

#: The dtypes Adasum reduces (Horovod's CPU implementation has no other).
ADASUM_DTYPES = (torch.float16, torch.float32, torch.float64)
#: Below this squared norm a vector's coefficient is 1 (Horovod's threshold, ``sqrt(DBL_MIN)``).
SQRT_DBL_MIN = sys.float_info.min ** 0.5

_NAME = "adasum_allreduce"


@overload
def adasum_allreduce(comm: Communicator, tensor: torch.Tensor, *, check: bool = True) -> torch.Tensor: ...


@overload
def adasum_allreduce(comm: Communicator, tensor: Sequence[torch.Tensor], *,
                     check: bool = True) -> list[torch.Tensor]: ...


def adasum_allreduce(comm: Communicator, tensor: torch.Tensor | Sequence[torch.Tensor], *,
                     check: bool = True) -> torch.Tensor | list[torch.Tensor]:
    """Combine every rank's ``tensor`` by Adasum, in place; returns it (the same on every rank).

    ``tensor`` may also be a list of tensors of one dtype: they travel together, and each is
    combined with its own dot products (Horovod's fused Adasum). Unless ``check=False``, the
    ranks first agree on the call (dtype, shapes, op), and a rank whose call differs or is
    invalid makes every rank raise the same :class:`MismatchError` / :class:`InvalidCallError`.
    A number of ranks that is not a power of two raises ``NotImplementedError`` on every rank.
    """
    tensors = [tensor] if isinstance(tensor, torch.Tensor) else list(tensor)
    p = comm.size
    if p & (p - 1):
        raise NotImplementedError(
            f"Running Adasum with non-power of 2 ranks is not supported yet: {comm.name} has {p} ranks "
            f"({_NAME}). Run on 1, 2, 4, 8, ... ranks, or reduce with op='average'"
        )
    seq = next_seq(comm)
    try:
        ctx = _start(comm, seq, tensors, check)
    except (TypeError, ValueError, CommError) as exc:
        _refuse(comm, seq, check, exc)
    if p > 1:
        t0 = time.perf_counter_ns()
        if check:
            exchange_headers(ctx)
        n = sum(t.numel() for t in tensors)
        if n:
            flat = tensors[0].view(-1) if len(tensors) == 1 else torch.cat([t.view(-1) for t in tensors])
            lengths = [t.numel() for t in tensors]
            _vhdd(ctx, flat, lengths)
            if len(tensors) > 1:
                for t, part in zip(tensors, flat.split(lengths), strict=True):
                    t.view(-1).copy_(part)
        nbytes = n * tensors[0].element_size()
        comm.log.record("allreduce", nbytes, -1, t0, time.perf_counter_ns(), 0, comm.name,
                        collective="allreduce", cid=seq, algorithm="adasum")
    return tensor if isinstance(tensor, torch.Tensor) else tensors


def _start(comm: Communicator, seq: int, tensors: list[torch.Tensor], check: bool) -> Ctx:
    """Check the arguments and build the call's context (raises before any message)."""
    if not tensors:
        raise ValueError(f"{_NAME}: no tensors given; pass a tensor or a non-empty list of tensors")
    for t in tensors:
        comm._check_tensor(t, _NAME)
    dtypes = sorted({dtype_name(t.dtype) for t in tensors})
    if len(dtypes) > 1:
        raise CommError(f"{_NAME}: the tensors have different dtypes ({', '.join(dtypes)}); "
                        "reduce tensors of each dtype in a call of their own")
    dtype = tensors[0].dtype
    if dtype not in ADASUM_DTYPES:
        valid = ", ".join(dtype_name(d) for d in ADASUM_DTYPES)
        raise CommError(f"{_NAME}: Adasum reduces {valid} tensors, not {dtype_name(dtype)}; "
                        "convert the tensor or reduce it with op='sum' or 'average'")
    shapes = [list(t.shape) for t in tensors]
    shape: list[int] | list[list[int]] = shapes[0] if len(tensors) == 1 else shapes
    numel = sum(t.numel() for t in tensors)
    call = CallInfo.make(seq, "allreduce", ReduceOp.ADASUM, dtype, numel, -1, "auto", shape)
    desc = {"collective": "allreduce", "seq": seq, "dtype": dtype_name(dtype), "numel": numel,
            "shape": shape, "op": ReduceOp.ADASUM.value, "root": None, "algorithm": "adasum"}
    return Ctx(comm, "allreduce", seq, ReduceOp.ADASUM, "adasum", check, call, tensors[0].device, desc)


def _refuse(comm: Communicator, seq: int, check: bool, error: Exception) -> None:
    """Raise ``error``'s problem on every rank (through the header exchange, unless unchecked)."""
    if not check:
        raise error
    text = invalid_message(comm.rank, "allreduce", seq, str(error))
    if comm.size == 1:
        from ringpipe.check.call import InvalidCallError

        raise InvalidCallError(text) from error
    ctx = Ctx(comm, "allreduce", seq, None, "adasum", check, CallInfo.invalid(seq, "allreduce"),
              home_device(comm), {"collective": "allreduce", "seq": seq, "invalid": str(error)})
    try:
        exchange_headers(ctx, invalid=text)
    except MismatchError as exc:
        raise exc.with_traceback(None) from error
    raise AssertionError("the header exchange of an invalid call always raises")  # unreachable


def _vhdd(ctx: Ctx, x: torch.Tensor, lengths: list[int]) -> None:
    """Adasum of the flat ``x`` (tensors of ``lengths`` one after another) in place."""
    comm = ctx.comm
    p, r = comm.size, comm.rank
    nb = (x.numel() - x.numel() // 2) * x.element_size()
    recv = ctx.scratch("adasum", nb)[:nb].view(x.dtype)
    lo, hi = 0, x.numel()
    segments: list[tuple[int, int]] = []
    level = 1
    while level < p:  # vector halving, distance doubling: combine the halves kept
        peer = r ^ level
        mid = lo + (hi - lo) // 2
        right = bool(r & level)
        (klo, khi), (glo, ghi) = ((mid, hi), (lo, mid)) if right else ((lo, mid), (mid, hi))
        segments.append((lo, hi))
        theirs = recv[:khi - klo]
        exchange(ctx, peer, x[glo:ghi], peer, theirs)
        _combine(ctx, x[klo:khi], theirs, klo, lengths, level, right)
        lo, hi = klo, khi
        level <<= 1
    while segments:  # distance halving: gather the combined halves back
        level >>= 1
        plo, phi = segments.pop()
        peer = r ^ level
        olo, ohi = (plo, lo) if lo > plo else (hi, phi)
        exchange(ctx, peer, x[lo:hi], peer, x[olo:ohi])
        lo, hi = plo, phi


def _combine(ctx: Ctx, a: torch.Tensor, b: torch.Tensor, start: int, lengths: list[int], level: int,
             right: bool) -> None:
    """``a = ca * a + cb * b`` on this rank's piece of every tensor, with each tensor's coefficients.

    ``a`` (this rank's values) and ``b`` (the partner's) cover elements ``start ..`` of the
    fused buffer. Per tensor, the dot product and the squared norms of the left vector (that
    of the ranks whose bit ``level`` is clear) and the right one are summed over the ``2 level``
    ranks holding pieces of them.
    """
    a64 = a.to(torch.float64)
    b64 = b.to(torch.float64)
    stats = torch.zeros(3 * len(lengths), dtype=torch.float64, device=a.device)
    pieces: list[int] = []
    off, end = 0, start + a.numel()
    for i, n in enumerate(lengths):  # this rank's piece of tensor i: [max(off, start), min(off+n, end))
        s, e = max(off, start) - start, min(off + n, end) - start
        off += n
        pieces.append(max(0, e - s))
        if e <= s:
            continue
        pa, pb = a64[s:e], b64[s:e]
        mine, other = torch.dot(pa, pa), torch.dot(pb, pb)
        stats[3 * i] = torch.dot(pa, pb)
        stats[3 * i + 1] = other if right else mine
        stats[3 * i + 2] = mine if right else other
    incoming = torch.empty_like(stats)
    d = 1
    while d <= level:  # recursive doubling over the 2*level ranks: the same sums on all of them
        exchange(ctx, ctx.comm.rank ^ d, stats, ctx.comm.rank ^ d, incoming)
        stats = stats + incoming
        d <<= 1
    ca, cb = [], []
    for i in range(len(lengths)):
        dot, left, right_sq = stats[3 * i:3 * i + 3].tolist()
        anormsq, bnormsq = (right_sq, left) if right else (left, right_sq)
        ca.append(1.0 - dot / anormsq * 0.5 if anormsq >= SQRT_DBL_MIN else 1.0)
        cb.append(1.0 - dot / bnormsq * 0.5 if bnormsq >= SQRT_DBL_MIN else 1.0)
    if a.numel() == 0:
        return
    counts = torch.tensor(pieces, device=a.device)
    coef_a = torch.repeat_interleave(torch.tensor(ca, dtype=torch.float64, device=a.device), counts)
    coef_b = torch.repeat_interleave(torch.tensor(cb, dtype=torch.float64, device=a.device), counts)
    out = a64.mul(coef_a).addcmul_(b64, coef_b)
    a.copy_(out)
