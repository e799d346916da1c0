"""Collectives built from point-to-point messages, with a consistency check on every call.

``allreduce(comm, tensor, op, algorithm=...)`` and its siblings run a pure algorithm over
``comm.isend`` / ``comm.irecv`` on any communicator (gloo, NCCL, MPI), or the backend's own
collective with ``algorithm="native"``. Unless ``check=False``, every rank learns which call
every other rank is making from a small header carried by the first messages, and all ranks
raise :class:`MismatchError` if the calls differ (see :mod:`ringpipe.check.doubling_exchange`). The
native path runs the communicator's own check, which exchanges the same headers: ranks that
pick different algorithms for one call get the same error too.

``adasum_allreduce`` (or ``allreduce(..., op="adasum")``) combines gradients by Adasum
(:mod:`ringpipe.collectives.adasum`).

Arguments are checked before any message is sent. A rank whose arguments are wrong (an
unsupported dtype, a bad root, a length the ranks cannot split, an unknown op or algorithm)
still takes part in the header exchange, marked invalid with its error text, so that every
rank raises the same :class:`InvalidCallError` naming it instead of the others waiting for it
forever. ``check=False`` has no header exchange: a bad argument there raises on its own rank
only.

A communicator must be driven by one thread at a time. Both errors leave it usable: they are
raised before any payload is reduced, once every message of the exchange has arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from ringpipe.check.call import (
    DTYPES,
    CallInfo,
    InvalidCallError,
    MismatchError,
    dtype_name,
    invalid_message,
)
from ringpipe.check.doubling_exchange import next_seq
from ringpipe.collectives import (
    auto,
    halving_doubling,
    hierarchical,
    native,
    recursive_doubling,
    ring,
    tree,
)
from ringpipe.collectives.adasum import adasum_allreduce
from ringpipe.collectives.common import Ctx, exchange_headers, finish_average, home_device
from ringpipe.comm.base import CommError, Communicator, ReduceOp

__all__ = [
    "ALGORITHMS",
    "SUPPORTED",
    "InvalidCallError",
    "MismatchError",
    "adasum_allreduce",
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
    "native": native.allreduce,  # reached through auto only; asked for by name it runs below
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


#: What a refused argument raises (a non-tensor, an unknown op or algorithm, a bad root...).
_ARGUMENT_ERRORS = (TypeError, ValueError, CommError)


def _flat(comm: Communicator, tensor: torch.Tensor, what: str) -> torch.Tensor:
    # the communicator's own checks (a tensor, contiguous, on a device the backend serves),
    # made here, before the first message, rather than by the first isend
    comm._check_tensor(tensor, what)
    return tensor.view(-1)


def _check_root(comm: Communicator, root: int, what: str) -> None:
    if not isinstance(root, int) or not 0 <= root < comm.size:
        raise CommError(f"{what}: root {root!r} is not a rank of {comm.name} (size {comm.size})")


def _start(comm: Communicator, coll: str, seq: int, tensor: torch.Tensor, op: ReduceOp | None,
           root: int, requested: str, check: bool) -> tuple[Ctx, torch.Tensor, int]:
    """Check the tensor and build the call's context: (ctx, flat view, bytes of the input)."""
    flat = _flat(comm, tensor, coll)
    if tensor.dtype not in DTYPES:
        valid = ", ".join(dtype_name(d) for d in DTYPES)
        raise CommError(
            f"{coll}: dtype {tensor.dtype} is not supported by ringpipe's collectives (valid: {valid}); "
            "convert the tensor (e.g. bool -> uint8) or use algorithm='native'"
        )
    nbytes = flat.numel() * flat.element_size()
    algo = resolve(coll, requested, nbytes, comm)
    shape = list(tensor.shape)
    call = CallInfo.make(seq, coll, op, tensor.dtype, tensor.numel(), root, requested, shape)
    desc = {"collective": coll, "seq": seq, "dtype": dtype_name(tensor.dtype), "numel": tensor.numel(),
            "shape": shape, "op": None if op is None else op.value, "root": None if root < 0 else root,
            "algorithm": requested}
    return Ctx(comm, coll, seq, op, algo, check, call, tensor.device, desc), flat, nbytes


def _refuse(comm: Communicator, coll: str, seq: int, algorithm: object, check: bool,
            error: Exception) -> NoReturn:
    """Raise ``error``'s problem on every rank: take part in the header exchange marked invalid.

    Without a header exchange (``check=False``) ``error`` is raised here only: the other ranks
    cannot learn of it.
    """
    if not check:
        raise error
    text = invalid_message(comm.rank, coll, seq, str(error))
    if comm.size == 1:
        raise InvalidCallError(text) from error
    ctx = Ctx(comm, coll, seq, None, str(algorithm), check, CallInfo.invalid(seq, coll),
              home_device(comm), {"collective": coll, "seq": seq, "invalid": str(error)})
    try:
        exchange_headers(ctx, invalid=text)
    except MismatchError as exc:
        raise exc.with_traceback(None) from error
    raise AssertionError("the header exchange of an invalid call always raises")  # unreachable


def _is_adasum(op: object) -> bool:
    return op is ReduceOp.ADASUM or (isinstance(op, str) and op.lower() == ReduceOp.ADASUM.value)


def _not_adasum(op: ReduceOp | str, what: str) -> ReduceOp:
    """``op`` parsed; adasum is refused: it combines whole vectors, so only an allreduce has it."""
    rop = ReduceOp.parse(op)
    if rop is ReduceOp.ADASUM:
        raise CommError(f"{what}: op adasum is only available for allreduce (as in Horovod); "
                        "use allreduce(..., op='adasum') or another op")
    return rop


def _native(comm: Communicator, check: bool, run: Callable[[], Any]) -> Any:
    """The backend's own collective, checked across ranks by the communicator unless ``check=False``."""
    if check:
        return run()
    with comm.unchecked():
        return run()


def _auto_runs_native(comm: Communicator, tensor: torch.Tensor) -> bool:
    """Whether ``auto`` picks the backend's own allreduce for ``tensor``.

    Then the call takes the very path of ``algorithm="native"`` (the communicator's check and
    collective, nothing of ringpipe's in between), so that ``auto`` where native was measured
    fastest costs what native costs. Ranks that resolve ``auto`` differently still meet in the
    same header exchange and fail together. Tensors ringpipe's algorithms would refuse take the
    usual path and its error.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPES or comm.size < 2:
        return False
    return auto.choose("allreduce", tensor.numel() * tensor.element_size(), comm) == "native"


def _done(ctx: Ctx, nbytes: int, t0: int) -> None:
    ctx.comm.log.record(ctx.coll, nbytes, -1, t0, time.perf_counter_ns(), 0, ctx.comm.name,
                        collective=ctx.coll, cid=ctx.seq, algorithm=ctx.algo)


def allreduce(
    comm: Communicator,
    tensor: torch.Tensor,
    op: ReduceOp | str = ReduceOp.SUM,
    algorithm: str = "auto",
    *,
    check: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across the ranks of ``comm``; returns it.

    ``op``: sum, average (sum then divide; integers floor), min, max, product, or adasum
    (:func:`adasum_allreduce`, which has its own algorithm: ``algorithm`` must stay ``auto``).
    ``algorithm``: one of ``SUPPORTED["allreduce"]``. ``check=False`` skips the header check
    where it would cost a message of its own.
    """
    if _is_adasum(op):
        if algorithm != "auto":
            problem = ValueError(f"allreduce: op adasum runs its own algorithm; pass algorithm='auto', "
                                 f"not {algorithm!r}")
            _refuse(comm, "allreduce", next_seq(comm), algorithm, check, problem)
        return adasum_allreduce(comm, tensor, check=check)
    if algorithm == "native" or (algorithm == "auto" and _auto_runs_native(comm, tensor)):
        return _native(comm, check, lambda: comm.allreduce(tensor, op))
    seq = next_seq(comm)
    try:
        rop = ReduceOp.parse(op)
        requested = _algorithm("allreduce", algorithm)
        ctx, flat, nbytes = _start(comm, "allreduce", seq, tensor, rop, -1, requested, check)
    except _ARGUMENT_ERRORS as exc:
        _refuse(comm, "allreduce", seq, algorithm, check, exc)
    if comm.size == 1:
        return tensor
    t0 = time.perf_counter_ns()
    rd = ctx.algo == "recursive_doubling"
    if not rd and check:
        exchange_headers(ctx)  # recursive doubling carries the header in its own messages
    if flat.numel() or (rd and check):
        _ALLREDUCE[ctx.algo](ctx, flat)
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
    if algorithm == "native":
        return _native(comm, check, lambda: comm.reduce_scatter(tensor, op))
    seq = next_seq(comm)
    try:
        rop = _not_adasum(op, "reduce_scatter")
        requested = _algorithm("reduce_scatter", algorithm)
        if isinstance(tensor, torch.Tensor) and (tensor.dim() == 0 or tensor.shape[0] % comm.size):
            raise CommError(
                f"reduce_scatter: first dimension {tuple(tensor.shape)[:1]} must be divisible by the "
                f"number of ranks {comm.size}; pad the tensor"
            )
        ctx, flat, nbytes = _start(comm, "reduce_scatter", seq, tensor, rop, -1, requested, check)
    except _ARGUMENT_ERRORS as exc:
        _refuse(comm, "reduce_scatter", seq, algorithm, check, exc)
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
    if algorithm == "native":
        return _native(comm, check, lambda: comm.allgather(tensor))
    seq = next_seq(comm)
    try:
        requested = _algorithm("allgather", algorithm)
        ctx, flat, nbytes = _start(comm, "allgather", seq, tensor, None, -1, requested, check)
    except _ARGUMENT_ERRORS as exc:
        _refuse(comm, "allgather", seq, algorithm, check, exc)
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
    if algorithm == "native":
        return _native(comm, check, lambda: comm.broadcast(tensor, root))
    seq = next_seq(comm)
    try:
        _check_root(comm, root, "broadcast")
        requested = _algorithm("broadcast", algorithm)
        ctx, flat, nbytes = _start(comm, "broadcast", seq, tensor, None, root, requested, check)
    except _ARGUMENT_ERRORS as exc:
        _refuse(comm, "broadcast", seq, algorithm, check, exc)
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
    if algorithm == "native":
        return _native(comm, check, lambda: comm.reduce(tensor, root, op))
    seq = next_seq(comm)
    try:
        rop = _not_adasum(op, "reduce")
        _check_root(comm, root, "reduce")
        requested = _algorithm("reduce", algorithm)
        ctx, flat, nbytes = _start(comm, "reduce", seq, tensor, rop, root, requested, check)
    except _ARGUMENT_ERRORS as exc:
        _refuse(comm, "reduce", seq, algorithm, check, exc)
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
