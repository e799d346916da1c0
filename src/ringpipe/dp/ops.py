"""Collectives on tensors that autograd can differentiate through, run on the communicator's engine.

Gradients follow from what each collective computes, taking the training objective to be the
sum of every rank's loss: the gradient of an allreduce is the same allreduce of the output
gradients (Sum or Average), of an allgather the summed gradient of this rank's slice, of a
broadcast the summed gradient on the root (zero elsewhere), of a reduce-scatter an allgather,
and of an alltoall the reverse alltoall. Every collective is announced
(:mod:`ringpipe.dp.announce`), so ranks inside ``join()`` take part in allreduces.
"""

from __future__ import annotations

from typing import Any

import torch

from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.dp.announce import announce, finish, run_announced, wire_op
from ringpipe.dp.engine import Engine

__all__ = [
    "allreduce",
    "allgather",
    "broadcast",
    "reducescatter",
    "alltoall",
    "allreduce_inplace",
    "reducescatter_blocks",
]


def allreduce_inplace(
    comm: Communicator, tensor: torch.Tensor, op: ReduceOp, prescale: float = 1.0, postscale: float = 1.0
) -> torch.Tensor:
    """Reduce ``tensor`` in place (on the engine thread), with Horovod's pre/post scale factors."""

    def task() -> torch.Tensor:
        note = announce(comm, "allreduce", tensor, op)
        if prescale != 1.0:
            tensor.mul_(prescale)
        comm.iallreduce(tensor, wire_op(op, note)).wait()  # the form joined ranks use (MPI matches by form)
        finish(tensor, op, note)
        if postscale != 1.0:
            tensor.mul_(postscale)
        return tensor

    return Engine.of(comm).run(task, name="allreduce")


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator, op: ReduceOp, pre: float, post: float) -> torch.Tensor:
        ctx.comm, ctx.op, ctx.pre, ctx.post = comm, op, pre, post
        return allreduce_inplace(comm, tensor.detach().clone().contiguous(), op, pre, post)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise RuntimeError(
                f"allreduce with op {ctx.op.value} has no gradient in ringpipe; use Sum or Average to backpropagate"
            )
        out = allreduce_inplace(ctx.comm, grad.detach().clone().contiguous(), ctx.op, ctx.pre, ctx.post)
        return out, None, None, None, None


def allreduce(
    comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0, postscale: float = 1.0
) -> torch.Tensor:
    """Differentiable out-of-place allreduce."""
    return _Allreduce.apply(tensor, comm, op, prescale, postscale)


def _gather(comm: Communicator, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    parts = run_announced(comm, "allgather", lambda: comm.allgather(tensor.contiguous()))
    sizes = [int(p.shape[0]) if p.dim() else 1 for p in parts]
    if tensor.dim() == 0:
        return torch.stack(parts), sizes
    return torch.cat(parts, 0), sizes


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator) -> torch.Tensor:
        out, sizes = _gather(comm, tensor.detach())
        ctx.comm, ctx.sizes, ctx.scalar = comm, sizes, tensor.dim() == 0
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = allreduce_inplace(ctx.comm, grad.detach().clone().contiguous(), ReduceOp.SUM)
        start = sum(ctx.sizes[: ctx.comm.rank])
        mine = total[start : start + ctx.sizes[ctx.comm.rank]]
        return (mine.reshape(()) if ctx.scalar else mine), None


def allgather(comm: Communicator, tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable allgather: every rank's tensor concatenated along dim 0 (sizes may differ)."""
    return _Allgather.apply(tensor, comm)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator, root: int) -> torch.Tensor:
        ctx.comm, ctx.root = comm, root
        out = tensor.detach().clone().contiguous()
        return run_announced(comm, "broadcast", lambda: comm.broadcast(out, root))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = allreduce_inplace(ctx.comm, grad.detach().clone().contiguous(), ReduceOp.SUM)
        if ctx.comm.rank != ctx.root:
            total.zero_()
        return total, None, None


def broadcast(comm: Communicator, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    """Differentiable out-of-place broadcast from ``root``."""
    return _Broadcast.apply(tensor, comm, root)


def _split_sizes(n: int, size: int) -> list[int]:
    """Horovod's reduce-scatter split: the first ``n % size`` ranks get one extra row."""
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def reducescatter_blocks(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """This rank's block of dim 0 of the reduced ``tensor`` (dim 0 need not divide by size)."""
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    sizes = _split_sizes(tensor.shape[0], comm.size)
    x = tensor.detach().contiguous()
    if len(set(sizes)) == 1:
        return run_announced(comm, "reducescatter", lambda: comm.reduce_scatter(x, op))
    full = x.clone()
    run_announced(comm, "reducescatter", lambda: comm.allreduce(full, op))
    start = sum(sizes[: comm.rank])
    return full[start : start + sizes[comm.rank]].clone()


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator, op: ReduceOp) -> torch.Tensor:
        if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise ValueError(f"reducescatter supports op Sum or Average, got {op.value}")
        ctx.comm, ctx.op = comm, op
        return reducescatter_blocks(comm, tensor, op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        full, _ = _gather(ctx.comm, grad.detach())
        if ctx.op is ReduceOp.AVERAGE:
            full = full / ctx.comm.size
        return full, None, None


def reducescatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp = ReduceOp.AVERAGE) -> torch.Tensor:
    """Differentiable reduce-scatter along dim 0 (Horovod's split when it does not divide evenly)."""
    return _Reducescatter.apply(tensor, comm, op)


def _alltoall_raw(comm: Communicator, tensor: torch.Tensor, splits: list[int]) -> tuple[torch.Tensor, list[int]]:
    if len(splits) != comm.size or sum(splits) != tensor.shape[0] or min(splits) < 0:
        raise ValueError(
            f"alltoall splits {splits} must have one non-negative entry per rank ({comm.size}) summing to "
            f"dim 0 of the tensor ({tensor.shape[0]})"
        )
    engine = Engine.of(comm)
    counts = [torch.tensor([s], dtype=torch.int64) for s in splits]
    received = [int(c) for c in run_announced(comm, "alltoall", lambda: comm.alltoall(counts), "alltoall-splits")]
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
        ctx: Any, tensor: torch.Tensor, comm: Communicator, splits: list[int], box: list[list[int]]
    ) -> torch.Tensor:
        out, received = _alltoall_raw(comm, tensor, splits)
        ctx.comm, ctx.received = comm, received
        box.append(received)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back, _ = _alltoall_raw(ctx.comm, grad.contiguous(), ctx.received)
        return back, None, None, None


def alltoall(
    comm: Communicator, tensor: torch.Tensor, splits: list[int] | torch.Tensor | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Differentiable alltoall along dim 0: rows ``splits[j]`` go to rank ``j`` (even split by default).

    Returns the received rows (in rank order) and how many came from each rank.
    """
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        if tensor.shape[0] % comm.size:
            raise ValueError(
                f"alltoall without splits needs dim 0 ({tensor.shape[0]}) divisible by size {comm.size}; pass splits"
            )
        splits = [tensor.shape[0] // comm.size] * comm.size
    as_list = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    box: list[list[int]] = []
    out = _Alltoall.apply(tensor, comm, as_list, box)
    return out, box[0]
