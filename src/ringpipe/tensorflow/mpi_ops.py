"""Horovod's TensorFlow collectives on ringpipe's engine, eager and in graphs, with Horovod's gradients.

Each op converts its TF tensor at the boundary (:mod:`.bridge`) and calls the collective every
face shares (:mod:`ringpipe.core.reductions`, :mod:`ringpipe.core.movement`), which announces the call across ranks (ranks that disagree all raise) and runs it on
the process set's engine. The gradients are Horovod's (``horovod/tensorflow/mpi_ops.py``): of an
allreduce, the same allreduce (op and scale factors) of the output gradient; of an allgather, the
averaging allreduce of the gradient, this rank's rows; of a broadcast, the averaging allreduce on
the root rank and zero elsewhere; of a reduce-scatter, the allgather of the gradient times the
set's size for Sum and times the scale factors; of an alltoall, the alltoall back with the
received splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf
import torch

from ringpipe.check.announcement import checks, run_announced
from ringpipe.comm.base import ReduceOp
from ringpipe.core import basics as _basics_api
from ringpipe.core import movement as _movement
from ringpipe.core import ops as _ops
from ringpipe.core import reductions as _reductions
from ringpipe.core.calls import Call, parse_op
from ringpipe.core.process_sets import ProcessSet, global_process_set
from ringpipe.core.process_sets import basics as _basics  # noqa: F401 - Horovod's internal, read by its tests
from ringpipe.dp.join import join_process_set

try:  # TensorFlow's check for a recording tape (private; see _recording)
    from tensorflow.python.eager import record as _record
except ImportError:  # pragma: no cover - depends on the TensorFlow version
    _record = None

from .bridge import as_tensor, graph_op, run, to_tf, to_torch
from .compression import Compression

__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "join",
    "reducescatter",
]


def _recording() -> bool:
    """Whether a gradient tape may record now (else an eager op skips ``tf.custom_gradient``, ~1 ms a call).

    Outside ``tf.function`` TensorFlow builds the custom-gradient wrapper on every call even when
    no tape watches; TensorFlow's own check for a recording tape is private, so when it is not
    there the wrapper is always built.
    """
    if _record is None or not tf.executing_eagerly():
        return True
    return bool(_record.could_possibly_record())


def _torch_of(x: tf.Tensor, what: str, name: str | None, process_set: ProcessSet) -> torch.Tensor:
    """``x`` as a torch tensor for collective ``what``; a dtype no collective takes is refused on every rank.

    The refusal is announced as an invalid call, so the other ranks of the set, waiting in the
    same collective, raise the same :class:`~ringpipe.check.call.InvalidCallError` naming this
    rank and the dtype instead of waiting for a rank that will never come.
    """
    try:
        return to_torch(x)
    except TypeError as exc:
        call = Call(what, process_set, name)
        run_announced(call.comm, what, lambda: None, name, detail=call.detail,
                      validate=checks(call.comm, what, problem=exc), key=call.key)
        raise  # not reached: the announcement raises on every rank, this one included


def _set_size(process_set: ProcessSet) -> int:
    ranks = process_set.ranks
    if not ranks:
        raise ValueError("ringpipe.tensorflow: call init() first (the process set has no ranks yet)")
    return len(ranks)


def _set_rank(process_set: ProcessSet) -> int:
    rank = process_set.rank()
    assert rank is not None
    return rank


# ----------------------------------------------------------------------------- allreduce


def _dense_allreduce(x: tf.Tensor, op: ReduceOp, pre: float, post: float, compression: Any, name: str | None,
                     process_set: ProcessSet) -> tf.Tensor:
    def fn(v: tf.Tensor) -> list[tf.Tensor]:
        src = _torch_of(v, "allreduce", name, process_set)
        out = _reductions.allreduce(src, name=name, compression=compression, op=op, prescale_factor=pre,
                             postscale_factor=post, process_set=process_set)
        return [to_tf(out)]

    if not _recording():
        return fn(x)[0]

    @tf.custom_gradient
    def reduce(t: tf.Tensor) -> Any:
        (y,) = run(fn, [t], [t.dtype], [t.shape], name="RingpipeAllreduce")

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return _dense_allreduce(dy, op, pre, post, compression, None, process_set)

        return y, grad

    return reduce(x)


def _check_sparse(rop: ReduceOp, pre: float, post: float) -> None:
    """Horovod's limits for a ``tf.IndexedSlices`` (checked before anything is communicated)."""
    if rop is ReduceOp.ADASUM:
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a "
                                  "workaround please pass sparse_as_dense=True to DistributedOptimizer")
    if rop not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


@graph_op
def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Reduce a ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices`` over ranks (Average by default).

    An ``IndexedSlices`` is reduced as Horovod does: the values and indices of every rank are
    gathered (divided by the set's size for Average), duplicates not summed.
    """
    rop = parse_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(rop, prescale_factor, postscale_factor)
        values = allgather(tensor.values, process_set=process_set)
        indices = allgather(tensor.indices, process_set=process_set)
        if rop is ReduceOp.AVERAGE:
            values = values / tf.cast(_set_size(process_set), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    return _dense_allreduce(as_tensor(tensor), rop, prescale_factor, postscale_factor,
                            Compression.parse(compression), name, process_set)


@graph_op
def fused_allreduce(tensors: Sequence[tf.Tensor], op: ReduceOp, pre: float, post: float, compression: Any,
                    process_set: ProcessSet) -> list[tf.Tensor]:
    """Reduce dense tensors as one message per dtype (one graph node); differentiable."""
    comp = Compression.parse(compression)
    xs = [as_tensor(t) for t in tensors]
    if not xs:
        return []

    def fn(*vs: tf.Tensor) -> list[tf.Tensor]:
        wire = [comp.compress(_torch_of(v, "grouped_allreduce", None, process_set)) for v in vs]
        groups: dict[torch.dtype, list[int]] = {}
        for i, (w, _) in enumerate(wire):
            groups.setdefault(w.dtype, []).append(i)
        handles = [(idx, _reductions.grouped_allreduce_async([wire[i][0] for i in idx], op=op, prescale_factor=pre,
                                                      postscale_factor=post, process_set=process_set))
                   for idx in groups.values()]
        out: list[Any] = [None] * len(vs)
        for idx, handle in handles:
            for i, r in zip(idx, _basics_api.synchronize(handle), strict=True):
                out[i] = to_tf(comp.decompress(r, wire[i][1]))
        return out

    if not _recording():
        return list(fn(*xs))

    @tf.custom_gradient
    def reduce(*ts: tf.Tensor) -> Any:
        ys = run(fn, list(ts), [t.dtype for t in ts], [t.shape for t in ts], name="RingpipeGroupedAllreduce")

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return fused_allreduce(list(dys), op, pre, post, comp, process_set)

        return ys, grad

    return list(reduce(*xs))


@graph_op
def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    name: str | None = None,
    ignore_name_scope: bool = False,
) -> list[Any]:
    """Reduce several tensors together (one fused message per dtype); ``IndexedSlices`` one by one."""
    rop = parse_op(op, average)
    items = list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in items):
        _check_sparse(rop, prescale_factor, postscale_factor)
    dense = [i for i, t in enumerate(items) if not isinstance(t, tf.IndexedSlices)]
    out: list[Any] = list(items)
    reduced = fused_allreduce([items[i] for i in dense], rop, prescale_factor, postscale_factor, compression,
                              process_set)
    for i, r in zip(dense, reduced, strict=True):
        out[i] = r
    for i, t in enumerate(items):
        if isinstance(t, tf.IndexedSlices):
            out[i] = allreduce(t, op=rop, process_set=process_set)
    return out


# ----------------------------------------------------------------------------- data movement


@graph_op
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's tensor concatenated along dim 0 (first dimensions may differ); differentiable."""
    x = as_tensor(tensor)

    @tf.custom_gradient
    def gather(t: tf.Tensor) -> Any:
        def fn(v: tf.Tensor) -> list[tf.Tensor]:
            src = _torch_of(v, "allgather", name, process_set)
            return [to_tf(_movement.allgather(src, name=name, process_set=process_set))]

        shape = None if t.shape.rank is None else ([None, *t.shape[1:]] if t.shape.rank else [None])
        (y,) = run(fn, [t], [t.dtype], [shape], name="RingpipeAllgather")

        def grad(dy: tf.Tensor) -> tf.Tensor:
            total = _dense_allreduce(dy, ReduceOp.AVERAGE, 1.0, 1.0, Compression.none, None, process_set)
            rows = tf.reshape(tf.shape(t, out_type=tf.int64)[0] if t.shape.rank else tf.constant(1, tf.int64), [1])
            sizes = allgather(rows, process_set=process_set)
            me = _set_rank(process_set)
            start = tf.reduce_sum(sizes[:me])
            mine = total[start : start + sizes[me]]
            return tf.reshape(mine, tf.shape(t))

        return y, grad

    return gather(x)


@graph_op
def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    return [allgather(t, process_set=process_set) for t in tensors]


@graph_op
def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s tensor (a world rank, also on a process set); differentiable."""
    x = as_tensor(tensor)

    @tf.custom_gradient
    def bcast(t: tf.Tensor) -> Any:
        def fn(v: tf.Tensor) -> list[tf.Tensor]:
            src = _torch_of(v, "broadcast", name, process_set)
            return [to_tf(_movement.broadcast(src, root_rank, name=name, process_set=process_set))]

        (y,) = run(fn, [t], [t.dtype], [t.shape], name="RingpipeBroadcast")

        def grad(dy: tf.Tensor) -> tf.Tensor:
            total = _dense_allreduce(dy, ReduceOp.AVERAGE, 1.0, 1.0, Compression.none, None, process_set)
            return total if _basics_api.rank() == root_rank else total * 0

        return y, grad

    return bcast(x)


@graph_op
def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Rows ``splits[j]`` of dim 0 go to rank ``j`` of the set (even split without ``splits``); differentiable.

    As in Horovod, with ``splits`` it returns ``(received, received_splits)``.
    """
    x = as_tensor(tensor)
    given = splits is not None
    spl = tf.cast(tf.convert_to_tensor(splits if given else tf.zeros([0], tf.int32)), tf.int32)

    @tf.custom_gradient
    def exchange(t: tf.Tensor, s: tf.Tensor) -> Any:
        def fn(v: tf.Tensor, w: tf.Tensor) -> list[tf.Tensor]:
            # the shared alltoall, keeping the received splits also of an even split (each
            # rank's own dim 0 / size rows, which differ between ranks): the gradient sends them back
            call = Call("alltoall", process_set, name)
            src = _torch_of(v, "alltoall", name, process_set)
            received, rsplits = _ops.alltoall(call.comm, src, [int(i) for i in w.numpy()] if given else None,
                                              call.detail)
            return [to_tf(received), to_tf(torch.tensor(rsplits, dtype=torch.int32))]

        shape = None if t.shape.rank is None else [None, *t.shape[1:]]
        y, rsplits = run(fn, [t, s], [t.dtype, tf.int32], [shape, [None]], name="RingpipeAlltoall")

        def grad(dy: tf.Tensor, _drs: Any = None) -> Any:
            back, _ = alltoall(dy, splits=rsplits, process_set=process_set)
            return back, None

        return (y, rsplits), grad

    y, rsplits = exchange(x, spl)
    return (y, rsplits) if given else y


@graph_op
def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: ReduceOp | str | None = ReduceOp.AVERAGE, name: str | None = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over ranks and keep this rank's block of dim 0 (Average by default); differentiable."""
    rop = parse_op(op, None)
    comp = Compression.parse(compression)
    x = as_tensor(tensor)

    @tf.custom_gradient
    def scatter(t: tf.Tensor) -> Any:
        def fn(v: tf.Tensor) -> list[tf.Tensor]:
            src = _torch_of(v, "reducescatter", name, process_set)
            out = _reductions.reducescatter(src, name=name, compression=comp, op=rop, process_set=process_set,
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor)
            return [to_tf(out)]

        shape = None if t.shape.rank is None else [None, *t.shape[1:]]
        (y,) = run(fn, [t], [t.dtype], [shape], name="RingpipeReducescatter")

        def grad(dy: tf.Tensor) -> tf.Tensor:
            factor = (_set_size(process_set) if rop is ReduceOp.SUM else 1) * prescale_factor * postscale_factor
            g = dy * tf.cast(factor, dy.dtype) if factor != 1 else dy
            return allgather(g, process_set=process_set)

        return y, grad

    return scatter(x)


@graph_op
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: Any = Compression.none,
                          op: ReduceOp | str | None = ReduceOp.AVERAGE, name: str | None = None,
                          process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[tf.Tensor]:
    return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor) for t in tensors]


@graph_op
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set reaches this call."""
    def wait() -> list[tf.Tensor]:
        _movement.barrier(process_set=process_set)
        return [tf.constant(0)]

    run(wait, [], [tf.int32], [[]], name="RingpipeBarrier")


@graph_op
def join() -> tf.Tensor:
    """Wait for every rank to run out of data (serving their allreduces meanwhile); the last rank to join."""
    (last,) = run(lambda: [tf.constant(join_process_set(), tf.int32)], [], [tf.int32], [[]], name="RingpipeJoin")
    return last
