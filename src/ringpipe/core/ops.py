"""Collectives on tensors that autograd can differentiate through, run on the communicator's engine.

Gradients follow Horovod's conventions (``horovod/torch/mpi_ops.py``), so that a Horovod program
trains the same: the gradient of an allreduce is the same allreduce of the output gradients;
of an allgather, the *averaging* allreduce of the output gradient, sliced to this rank's rows;
of a broadcast, the averaging allreduce on the root (zero elsewhere); of a reduce-scatter, the
allgather of the gradient scaled as the op scaled (times the size for Sum, times the pre- and
postscale factors); of an alltoall, the reverse alltoall. Every collective is announced
(:mod:`ringpipe.check.announcement`) with the arguments the ranks must agree on, so ranks inside
``join()`` take part in allreduces and ranks that disagree all raise before data moves.
"""

from __future__ import annotations

from typing import Any

import torch

from ringpipe.check.announcement import announce, checks, rides, run_announced
from ringpipe.comm.base import Communicator, ReduceOp, Work
from ringpipe.core.engine import Engine

__all__ = [
    "allreduce",
    "allgather",
    "broadcast",
    "reducescatter",
    "alltoall",
    "allreduce_inplace",
    "reducescatter_blocks",
    "finish_reduction",
    "scale_",
    "scale_detail",
    "wire_op",
    "start_reduction",
    "reduce_announced",
]

Detail = dict[str, Any] | None


def scale_detail(prescale: float, postscale: float) -> dict[str, float] | None:
    """Horovod's scale factors as announced arguments (left out when both are 1)."""
    if prescale == 1.0 and postscale == 1.0:
        return None
    return {"prescale_factor": float(prescale), "postscale_factor": float(postscale)}


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``tensor`` in place by ``factor`` as Horovod scales buffers.

    Integer tensors are scaled in double precision and truncated toward zero on the way back
    (C++'s conversion in Horovod's ``ScaleBuffer``), instead of failing to cast a float result.
    """
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.mul_(factor)
    if tensor.dtype == torch.bool:
        raise TypeError("prescale_factor / postscale_factor cannot scale a bool tensor")
    return tensor.copy_(torch.trunc(tensor.double() * factor).to(tensor.dtype))


def wire_op(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, postscale: float) -> tuple[ReduceOp, float]:
    """The reduce op that goes on the wire and the post-scale factor after it, as Horovod averages.

    Horovod averages by its post-scale factor: the sum, then one scaling by ``postscale / size``
    (``horovod/common/operations.cc``). For integer tensors that scaling multiplies in double
    precision and converts back by truncating toward zero (:func:`scale_`), so an integer average
    of -7 over 2 ranks is -3, not the -4 of a floored division. Floating-point averages and every
    other op are left as they are (a division by the size).
    """
    if op is ReduceOp.AVERAGE and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex
                                       or tensor.dtype == torch.bool):
        return ReduceOp.SUM, postscale / comm.size
    return op, postscale


def start_reduction(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> Any:
    """The reduction of an announced allreduce: the backend's (a Work), or ringpipe's Adasum (done)."""
    if op is ReduceOp.ADASUM:
        from ringpipe.collectives import adasum_allreduce

        return adasum_allreduce(comm, tensor, check=False)  # the announcement compared the calls
    return comm.iallreduce(tensor, op)


def reduce_announced(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, wop: ReduceOp, prescale: float,
                     detail: Detail, validate: Any) -> Any:
    """Announce an allreduce of ``tensor`` (engine thread) and start its reduction by ``wop``, prescaled.

    A Sum or Average of a float tensor that fits the announcement's payload area travels in it
    (:func:`~ringpipe.check.announcement.rides`): one message, and ``tensor`` holds the result when this
    returns; otherwise the data follows the announcement (:func:`start_reduction`'s result). Either
    way the post-scaling is the caller's, and ``tensor`` is untouched if the ranks' calls differ.
    """
    if wop is op and rides(comm, op, tensor.dtype, tensor.numel(), tensor.device.type == "cuda",
                           Engine.of(comm).ride):
        flat = tensor.reshape(-1)
        if prescale != 1.0:
            flat = flat * prescale  # scaled in the tensor's dtype, as the data that follows would be
        note = announce(comm, "allreduce", tensor, op, detail, validate, payload=flat)
        assert note.payload is not None
        summed = note.payload[: tensor.numel()]
        if op is ReduceOp.AVERAGE:
            summed.div_(comm.size)  # in float32, then rounded once into the tensor's dtype
        with torch.no_grad():
            tensor.copy_(summed.view(tensor.shape))
        return tensor
    announce(comm, "allreduce", tensor, op, detail, validate)
    scale_(tensor, prescale)
    return start_reduction(comm, tensor, wop)


def finish_reduction(pending: Any) -> Any:
    """Wait for what :func:`start_reduction` returned."""
    return pending.wait() if isinstance(pending, Work) else pending


def _with(detail: Detail, more: Detail) -> Detail:
    if not detail and not more:
        return None
    return {**(detail or {}), **(more or {})}


def allreduce_inplace(
    comm: Communicator, tensor: torch.Tensor, op: ReduceOp, prescale: float = 1.0, postscale: float = 1.0,
    detail: Detail = None, problem: BaseException | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place (on the engine thread), with Horovod's pre/post scale factors."""

    def task() -> torch.Tensor:
        rop, post = wire_op(comm, tensor, op, postscale)
        # the data follows non-blocking, the form joined ranks use
        finish_reduction(reduce_announced(comm, tensor, op, rop, prescale,
                                          _with(detail, scale_detail(prescale, postscale)),
                                          checks(comm, "allreduce", tensor, problem=problem)))
        scale_(tensor, post)
        return tensor

    return Engine.of(comm).run(task, name="allreduce")


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator, op: ReduceOp, pre: float, post: float,
                detail: Detail, problem: BaseException | None) -> torch.Tensor:
        ctx.comm, ctx.op, ctx.pre, ctx.post, ctx.detail = comm, op, pre, post, detail
        return allreduce_inplace(comm, tensor.detach().clone().contiguous(), op, pre, post, detail, problem)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op not in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM):
            raise RuntimeError(
                f"allreduce with op {ctx.op.value} has no gradient in ringpipe; use Sum, Average or Adasum to "
                "backpropagate"
            )
        out = allreduce_inplace(ctx.comm, grad.detach().clone().contiguous(), ctx.op, ctx.pre, ctx.post, ctx.detail)
        return out, None, None, None, None, None, None


def allreduce(
    comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0,
    postscale: float = 1.0, detail: Detail = None, problem: BaseException | None = None,
) -> torch.Tensor:
    """Differentiable out-of-place allreduce."""
    return _Allreduce.apply(tensor, comm, op, prescale, postscale, detail, problem)


def _gather(comm: Communicator, tensor: torch.Tensor, detail: Detail = None,
            problem: BaseException | None = None) -> tuple[torch.Tensor, list[int]]:
    x = tensor.contiguous()
    parts = run_announced(comm, "allgather", lambda: comm.allgather(x), tensor=x, detail=detail,
                          validate=checks(comm, "allgather", x, problem=problem))
    sizes = [int(p.shape[0]) if p.dim() else 1 for p in parts]
    if tensor.dim() == 0:
        return torch.stack(parts), sizes
    return torch.cat(parts, 0), sizes


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator, detail: Detail,
                problem: BaseException | None) -> torch.Tensor:
        out, sizes = _gather(comm, tensor.detach(), detail, problem)
        ctx.comm, ctx.sizes, ctx.scalar, ctx.detail = comm, sizes, tensor.dim() == 0, detail
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = allreduce_inplace(ctx.comm, grad.detach().clone().contiguous(), ReduceOp.AVERAGE, detail=ctx.detail)
        start = sum(ctx.sizes[: ctx.comm.rank])
        mine = total[start : start + ctx.sizes[ctx.comm.rank]]
        return (mine.reshape(()) if ctx.scalar else mine), None, None, None


def allgather(comm: Communicator, tensor: torch.Tensor, detail: Detail = None,
              problem: BaseException | None = None) -> torch.Tensor:
    """Differentiable allgather: every rank's tensor concatenated along dim 0 (sizes may differ)."""
    return _Allgather.apply(tensor, comm, detail, problem)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator, root: int, detail: Detail,
                problem: BaseException | None) -> torch.Tensor:
        ctx.comm, ctx.root, ctx.detail = comm, root, detail
        out = tensor.detach().clone().contiguous()
        return run_announced(comm, "broadcast", lambda: comm.broadcast(out, root), tensor=out,
                             detail=_with(detail, {"root_rank": root}),
                             validate=checks(comm, "broadcast", out, root, problem=problem))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = allreduce_inplace(ctx.comm, grad.detach().clone().contiguous(), ReduceOp.AVERAGE, detail=ctx.detail)
        if ctx.comm.rank != ctx.root:
            total.zero_()
        return total, None, None, None, None


def broadcast(comm: Communicator, tensor: torch.Tensor, root: int = 0, detail: Detail = None,
              problem: BaseException | None = None) -> torch.Tensor:
    """Differentiable out-of-place broadcast from ``root`` (a rank of ``comm``)."""
    return _Broadcast.apply(tensor, comm, root, detail, problem)


def _split_sizes(n: int, size: int) -> list[int]:
    """Horovod's reduce-scatter split: the first ``n % size`` ranks get one extra row."""
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def reducescatter_blocks(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, prescale: float = 1.0,
                         postscale: float = 1.0, detail: Detail = None,
                         problem: BaseException | None = None) -> torch.Tensor:
    """This rank's block of dim 0 of the reduced ``tensor`` (dim 0 need not divide by size)."""
    if problem is None and tensor.dim() == 0:
        problem = ValueError("reducescatter needs a tensor with at least one dimension")
    if problem is None and op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        problem = ValueError(f"reducescatter supports op Sum or Average, got {op.value}")
    x = scale_(tensor.detach().contiguous().clone(), prescale)
    sizes = _split_sizes(tensor.shape[0], comm.size) if tensor.dim() else [0]
    detail = _with(_with(detail, {"op": op.value}), scale_detail(prescale, postscale))
    validate = checks(comm, "reducescatter", x, problem=problem)
    rop, post = wire_op(comm, x, op, postscale)
    if len(set(sizes)) == 1:
        out = run_announced(comm, "reducescatter", lambda: comm.reduce_scatter(x, rop), tensor=x, detail=detail,
                            validate=validate)
        return scale_(out, post)
    run_announced(comm, "reducescatter", lambda: comm.allreduce(x, rop), tensor=x, detail=detail, validate=validate)
    start = sum(sizes[: comm.rank])
    return scale_(x[start : start + sizes[comm.rank]].clone(), post)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator, op: ReduceOp, pre: float, post: float,
                detail: Detail, problem: BaseException | None) -> torch.Tensor:
        ctx.comm, ctx.op, ctx.pre, ctx.post, ctx.detail = comm, op, pre, post, detail
        return reducescatter_blocks(comm, tensor, op, pre, post, detail, problem)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        g = grad.detach()
        factor = (ctx.comm.size if ctx.op is ReduceOp.SUM else 1) * ctx.pre * ctx.post
        if factor != 1:
            g = g * factor
        full, _ = _gather(ctx.comm, g, ctx.detail)
        return full, None, None, None, None, None, None


def reducescatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0,
                  postscale: float = 1.0, detail: Detail = None,
                  problem: BaseException | None = None) -> torch.Tensor:
    """Differentiable reduce-scatter along dim 0 (Horovod's split when it does not divide evenly)."""
    return _Reducescatter.apply(tensor, comm, op, prescale, postscale, detail, problem)


def _alltoall_raw(comm: Communicator, tensor: torch.Tensor, splits: list[int], detail: Detail = None,
                  problem: BaseException | None = None) -> tuple[torch.Tensor, list[int]]:
    if problem is None and (len(splits) != comm.size or sum(splits) != tensor.shape[0] or min(splits) < 0):
        problem = ValueError(
            f"alltoall splits {splits} must have one non-negative entry per rank ({comm.size}) summing to "
            f"dim 0 of the tensor ({tensor.shape[0]})"
        )
    engine = Engine.of(comm)
    counts = [torch.tensor([s], dtype=torch.int64) for s in splits] if problem is None else []
    detail = _with(detail, {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": ["*", *tensor.shape[1:]]})
    received = [int(c) for c in run_announced(comm, "alltoall", lambda: comm.alltoall(counts), "alltoall-splits",
                                              detail=detail, validate=checks(comm, "alltoall", tensor, problem=problem))]
    longest = torch.tensor([max(splits + received)], dtype=torch.int64)
    engine.run(lambda: comm.allreduce(longest, ReduceOp.MAX), name="alltoall-splits")
    pad = int(longest)
    rest = tuple(tensor.shape[1:])
    chunks = []
    for chunk in torch.split(tensor.detach(), splits, 0):
        padded = tensor.new_zeros((pad, *rest))
        padded[: chunk.shape[0]] = chunk
        chunks.append(padded)
    got = engine.run(lambda: comm.alltoall(chunks), name="alltoall")
    return torch.cat([g[:n] for g, n in zip(got, received, strict=True)], 0), received


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, comm: Communicator, splits: list[int], box: list[list[int]], detail: Detail,
        problem: BaseException | None,
    ) -> torch.Tensor:
        out, received = _alltoall_raw(comm, tensor, splits, detail, problem)
        ctx.comm, ctx.received, ctx.detail = comm, received, detail
        box.append(received)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back, _ = _alltoall_raw(ctx.comm, grad.contiguous(), ctx.received, ctx.detail)
        return back, None, None, None, None, None


def alltoall(
    comm: Communicator, tensor: torch.Tensor, splits: list[int] | torch.Tensor | None = None, detail: Detail = None,
    problem: BaseException | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Differentiable alltoall along dim 0: rows ``splits[j]`` go to rank ``j`` (even split by default).

    Returns the received rows (in rank order) and how many came from each rank.
    """
    if problem is None and tensor.dim() == 0:
        problem = ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        n = tensor.shape[0] if tensor.dim() else 0
        if problem is None and n % comm.size:
            problem = ValueError(
                f"alltoall without splits needs dim 0 ({n}) divisible by size {comm.size}; pass splits"
            )
        splits = [n // comm.size] * comm.size
    as_list = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    box: list[list[int]] = []
    out = _Alltoall.apply(tensor, comm, as_list, box, detail, problem)
    return out, box[0]
