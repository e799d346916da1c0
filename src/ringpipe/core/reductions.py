"""Horovod's reductions: allreduce, grouped allreduce, reduce-scatter and their in-place and async forms.

The naming grid follows Horovod: ``op`` returns a new tensor (differentiable), ``op_`` works in
place, ``op_async`` / ``op_async_`` return a :class:`~ringpipe.core.engine.Handle` for
``synchronize``. Every call takes ``process_set`` and is announced with its arguments (dtype,
shape, op, scale factors, set), so ranks that disagree all raise before data moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringpipe.check.announcement import announce, checks
from ringpipe.comm.base import ReduceOp
from ringpipe.core import ops
from ringpipe.core.compression import Compression
from ringpipe.core.engine import Handle
from ringpipe.core.process_sets import ProcessSet, global_process_set

from .basics import synchronize
from .calls import Call, parse_op

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
]


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over ranks into a new tensor (Average by default); differentiable."""
    call = Call("allreduce", process_set, name)
    comp = Compression.parse(compression)
    wire, ctx = comp.compress(tensor)
    out = ops.allreduce(call.comm, wire, parse_op(op, average), prescale_factor, postscale_factor,
                        detail=call.detail)
    return comp.decompress(out, ctx)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor`` once reduced."""
    call = Call("allreduce", process_set, name)
    comm, rop = call.comm, parse_op(op, average)
    detail = {**call.detail, **(ops.scale_detail(prescale_factor, postscale_factor) or {})}

    wop, post = ops.wire_op(comm, tensor, rop, postscale_factor)

    def task() -> Any:
        return ops.reduce_announced(comm, tensor, rop, wop, prescale_factor, detail, checks(comm, "allreduce", tensor))

    def then(out: torch.Tensor) -> torch.Tensor:
        ops.scale_(tensor, post)
        return tensor

    return call.submit(task, then)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over ranks in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce into a new tensor; ``synchronize(handle)`` returns it."""
    return allreduce_async_(tensor.detach().clone().contiguous(), average, name, op, prescale_factor,
                            postscale_factor, process_set)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Reduce several tensors in place as one fused message; ``synchronize`` returns the list."""
    call = Call("grouped_allreduce", process_set, name)
    comm, rop = call.comm, parse_op(op, average)
    items = list(tensors)
    if not items:
        return call.submit(lambda: [])
    kinds = {(t.dtype, t.device) for t in items}
    problem = None
    if len(kinds) != 1:
        problem = ValueError(f"grouped_allreduce needs tensors of one dtype and device, got {sorted(map(str, kinds))}")
    flat = torch.cat([t.detach().reshape(-1).to(items[0].dtype) for t in items])
    detail = {**call.detail, "shapes": [list(t.shape) for t in items],
              **(ops.scale_detail(prescale_factor, postscale_factor) or {})}
    wop, post = ops.wire_op(comm, flat, rop, postscale_factor)

    def task() -> Any:
        validate = checks(comm, "grouped_allreduce", problem=problem)
        if rop is ReduceOp.ADASUM:  # each tensor with its own dot products, as Horovod's fused Adasum
            announce(comm, "allreduce", flat, rop, detail, validate)
            ops.scale_(flat, prescale_factor)
            ops.start_reduction(comm, list(flat.split([t.numel() for t in items])), rop)  # type: ignore[arg-type]
            return flat
        return ops.reduce_announced(comm, flat, rop, wop, prescale_factor, detail, validate)

    def then(out: torch.Tensor) -> list[torch.Tensor]:
        ops.scale_(flat, post)
        offset = 0
        with torch.no_grad():
            for t in items:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return items

    return call.submit(task, then)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    copies = [t.detach().clone() for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: ReduceOp | str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors (differentiable, one collective per tensor)."""
    return [allreduce(t, average, name and f"{name}.{i}", compression, op, prescale_factor, postscale_factor,
                      process_set) for i, t in enumerate(tensors)]


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: ReduceOp | str,
                           process_set: ProcessSet = global_process_set) -> Any:
    """Allreduce a sparse COO tensor by gathering every rank's indices and values (Horovod's way).

    Returns a callable handle: ``synchronize(handle)`` (or ``handle()``) gives the summed (or,
    with Average, averaged) sparse tensor, its duplicate indices not coalesced.
    """
    from .movement import allgather_async

    rop = parse_op(op, None)
    t = tensor
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t._values(), name=f"{name}.values", process_set=process_set)
    size = len(process_set.ranks or []) if process_set.process_set_id else None

    def handle() -> torch.Tensor:
        vals = synchronize(values)
        idx = synchronize(indices)
        if rop is ReduceOp.AVERAGE:
            vals = vals / (size or Call("sparse_allreduce", process_set, None).comm.size)
        if idx.dim() == 0 or vals.dim() == 0:
            return t.new().resize_as_(t)
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.size())

    return handle


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: ReduceOp | str | None = ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks and keep this rank's block of dim 0 (Average by default); differentiable.

    Dim 0 is split as in Horovod: the first ``n % size`` ranks get one more row.
    """
    call = Call("reducescatter", process_set, name)
    comp = Compression.parse(compression)
    wire, ctx = comp.compress(tensor)
    out = ops.reducescatter(call.comm, wire, parse_op(op, None), prescale_factor, postscale_factor,
                            detail=call.detail)
    return comp.decompress(out, ctx)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | str | None = ReduceOp.AVERAGE,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    call = Call("reducescatter", process_set, name)
    rop, x = parse_op(op, None), tensor.detach().clone()
    return call.submit(lambda: ops.reducescatter_blocks(call.comm, x, rop, prescale_factor, postscale_factor,
                                                        detail=call.detail))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | str | None = ReduceOp.AVERAGE,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Reduce-scatter several tensors, in order on the engine; ``synchronize`` returns the list."""
    call = Call("grouped_reducescatter", process_set, name)
    rop = parse_op(op, None)
    xs = [t.detach().clone() for t in tensors]

    def task() -> list[torch.Tensor]:
        return [ops.reducescatter_blocks(call.comm, x, rop, prescale_factor, postscale_factor, detail=call.detail)
                for x in xs]

    return call.submit(task)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: ReduceOp | str | None = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter several tensors (differentiable, one collective per tensor)."""
    return [reducescatter(t, name and f"{name}.{i}", compression, op, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]
