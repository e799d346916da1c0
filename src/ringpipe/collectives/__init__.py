"""Collectives built from point-to-point messages, with a consistency check on every call.

``allreduce(comm, tensor, op, algorithm=...)`` and its siblings run a pure algorithm over
``comm.isend`` / ``comm.irecv`` on any communicator (gloo, NCCL, MPI), or the backend's own
collective with ``algorithm="native"``. Unless ``check=False``, every rank learns which call
every other rank is making from a small header carried by the first messages, and all ranks
raise :class:`MismatchError` if the calls differ (see :mod:`ringpipe.collectives.header`).

A communicator must be driven by one thread at a time; after a :class:`MismatchError` it must
not be used again (messages of the failed call may still be in flight).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ringpipe.collectives import (
    auto,
    halving_doubling,
    hierarchical,
    recursive_doubling,
    ring,
    tree,
)
from ringpipe.collectives.common import Ctx, exchange_headers, finish_average
from ringpipe.collectives.header import CallInfo, MismatchError, next_seq
from ringpipe.comm.base import CommError, Communicator, ReduceOp

__all__ = [
    "ALGORITHMS",
    "SUPPORTED",
    "MismatchError",
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "resolve",
]

#: Every algorithm name; :data:`SUPPORTED` says which collectives offer which.
ALGORITHMS = ("auto", "ring", "rabenseifner", "recursive_doubling", "tree", "hierarchical", "native")

SUPPORTED: dict[str, tuple[str, ...]] = {
    "allreduce": ("auto", "ring", "rabenseifner", "recursive_doubling", "hierarchical", "native"),
    "reduce_scatter": ("auto", "ring", "native"),
    "allgather": ("auto", "ring", "native"),
    "broadcast": ("auto", "tree", "native"),
    "reduce": ("auto", "tree", "native"),
}

_ALLREDUCE: dict[str, Callable[[Ctx, torch.Tensor], None]] = {
    "ring": ring.allreduce,
    "rabenseifner": halving_doubling.allreduce,
    "recursive_doubling": recursive_doubling.allreduce,
    "hierarchical": hierarchical.allreduce,
}


def _algorithm(collective: str, algorithm: str) -> str:
    valid = SUPPORTED[collective]
    if algorithm not in valid:
        raise ValueError(
            f"unknown {collective} algorithm {algorithm!r}; valid algorithms: {', '.join(valid)}"
        )
    return algorithm


def resolve(collective: str, algorithm: str, nbytes: int, comm: Communicator) -> str:
    """The algorithm that actually runs (``auto`` resolved); ValueError for unknown names."""
    algo = _algorithm(collective, algorithm)
    return auto.choose(collective, nbytes, comm) if algo == "auto" else algo


def _flat(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise CommError(f"{what}: tensor must be contiguous (call .contiguous() first)")
    return tensor.view(-1)


def _start(comm: Communicator, coll: str, op: ReduceOp | None, tensor: torch.Tensor, root: int,
           requested: str, algo: str, check: bool, seq: int) -> Ctx:
    call = CallInfo.make(seq, coll, op, tensor.dtype, tensor.numel(), root, requested)
    return Ctx(comm, coll, seq, op, algo, check, call, tensor.device)


def _done(ctx: Ctx, nbytes: int, t0: int) -> None:
    ctx.comm.log.record(ctx.coll, nbytes, -1, t0, time.perf_counter_ns(), 0, ctx.comm.name,
                        collective=ctx.coll, cid=ctx.seq, algorithm=ctx.algo)


def _check_root(comm: Communicator, root: int, what: str) -> None:
    if not isinstance(root, int) or not 0 <= root < comm.size:
        raise CommError(f"{what}: root {root!r} is not a rank of {comm.name} (size {comm.size})")


def allreduce(
    comm: Communicator,
    tensor: torch.Tensor,
    op: ReduceOp | str = ReduceOp.SUM,
    algorithm: str = "auto",
    *,
    check: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across the ranks of ``comm``; returns it.

    ``op``: sum, average (sum then divide; integers floor), min, max, product.
    ``algorithm``: one of ``SUPPORTED["allreduce"]``. ``check=False`` skips the header check
    where it would cost a message of its own.
    """
    rop = ReduceOp.parse(op)
    flat = _flat(tensor, "allreduce")
    seq = next_seq(comm)
    requested = _algorithm("allreduce", algorithm)
    if requested == "native":
        return comm.allreduce(tensor, rop)
    nbytes = flat.numel() * flat.element_size()
    algo = resolve("allreduce", requested, nbytes, comm)
    ctx = _start(comm, "allreduce", rop, tensor, -1, requested, algo, check, seq)
    if comm.size == 1:
        return tensor
    t0 = time.perf_counter_ns()
    if algo != "recursive_doubling" and check:
        exchange_headers(ctx)  # recursive doubling carries the header in its own messages
    if flat.numel() or (algo == "recursive_doubling" and check):
        _ALLREDUCE[algo](ctx, flat)
    finish_average(flat, rop, comm.size)
    _done(ctx, nbytes, t0)
    return tensor


def reduce_scatter(
    comm: Communicator,
    tensor: torch.Tensor,
    op: ReduceOp | str = ReduceOp.SUM,
    algorithm: str = "auto",
    *,
    check: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's block of dim 0 (a new tensor).

    ``tensor.shape[0]`` must be divisible by the number of ranks; ``tensor`` is not modified.
    """
    rop = ReduceOp.parse(op)
    flat = _flat(tensor, "reduce_scatter")
    if tensor.dim() == 0 or tensor.shape[0] % comm.size:
        raise CommError(
            f"reduce_scatter: first dimension {tuple(tensor.shape)[:1]} must be divisible by the "
            f"number of ranks {comm.size}; pad the tensor"
        )
    seq = next_seq(comm)
    requested = _algorithm("reduce_scatter", algorithm)
    if requested == "native":
        return comm.reduce_scatter(tensor, rop)
    nbytes = flat.numel() * flat.element_size()
    algo = resolve("reduce_scatter", requested, nbytes, comm)
    ctx = _start(comm, "reduce_scatter", rop, tensor, -1, requested, algo, check, seq)
    out = torch.empty((tensor.shape[0] // comm.size, *tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    if comm.size == 1:
        return out.copy_(tensor)
    t0 = time.perf_counter_ns()
    if check:
        exchange_headers(ctx)
    if flat.numel():
        ring.reduce_scatter(ctx, flat, out.view(-1))
    finish_average(out, rop, comm.size)
    _done(ctx, nbytes, t0)
    return out


def allgather(
    comm: Communicator,
    tensor: torch.Tensor,
    algorithm: str = "auto",
    *,
    check: bool = True,
) -> list[torch.Tensor]:
    """Gather every rank's ``tensor`` (same shape on every rank); ``out[j]`` came from rank ``j``."""
    flat = _flat(tensor, "allgather")
    seq = next_seq(comm)
    requested = _algorithm("allgather", algorithm)
    if requested == "native":
        return comm.allgather(tensor)
    nbytes = flat.numel() * flat.element_size()
    algo = resolve("allgather", requested, nbytes, comm)
    ctx = _start(comm, "allgather", None, tensor, -1, requested, algo, check, seq)
    out = torch.empty((comm.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    if comm.size == 1:
        out[0].copy_(tensor)
        return list(out.unbind(0))
    t0 = time.perf_counter_ns()
    if check:
        exchange_headers(ctx)
    if flat.numel():
        ring.allgather(ctx, flat, out.view(-1))
    _done(ctx, nbytes * comm.size, t0)
    return list(out.unbind(0))


def broadcast(
    comm: Communicator,
    tensor: torch.Tensor,
    root: int = 0,
    algorithm: str = "auto",
    *,
    check: bool = True,
) -> torch.Tensor:
    """Copy ``root``'s ``tensor`` into every rank's ``tensor`` (in place); returns it."""
    flat = _flat(tensor, "broadcast")
    _check_root(comm, root, "broadcast")
    seq = next_seq(comm)
    requested = _algorithm("broadcast", algorithm)
    if requested == "native":
        return comm.broadcast(tensor, root)
    nbytes = flat.numel() * flat.element_size()
    algo = resolve("broadcast", requested, nbytes, comm)
    ctx = _start(comm, "broadcast", None, tensor, root, requested, algo, check, seq)
    if comm.size == 1:
        return tensor
    t0 = time.perf_counter_ns()
    if check:
        exchange_headers(ctx)
    if flat.numel():
        tree.broadcast(ctx, flat, root)
    _done(ctx, nbytes, t0)
    return tensor


def reduce(
    comm: Communicator,
    tensor: torch.Tensor,
    root: int = 0,
    op: ReduceOp | str = ReduceOp.SUM,
    algorithm: str = "auto",
    *,
    check: bool = True,
) -> torch.Tensor:
    """Reduce into ``root``'s ``tensor``; other ranks' tensors hold partial results afterwards."""
    rop = ReduceOp.parse(op)
    flat = _flat(tensor, "reduce")
    _check_root(comm, root, "reduce")
    seq = next_seq(comm)
    requested = _algorithm("reduce", algorithm)
    if requested == "native":
        return comm.reduce(tensor, root, rop)
    nbytes = flat.numel() * flat.element_size()
    algo = resolve("reduce", requested, nbytes, comm)
    ctx = _start(comm, "reduce", rop, tensor, root, requested, algo, check, seq)
    if comm.size == 1:
        return tensor
    t0 = time.perf_counter_ns()
    if check:
        exchange_headers(ctx)
    if flat.numel():
        tree.reduce(ctx, flat, root)
    if comm.rank == root:
        finish_average(flat, rop, comm.size)
    _done(ctx, nbytes, t0)
    return tensor
