"""Horovod's graph-time queries: ``size_op``, ``rank_op``, ``local_*_op``, ``process_set_included_op``.

Also ``check_num_rank_power_of_2``, the test ``horovod.tensorflow`` exports for Adasum's rule that
the number of ranks be a power of two.

Each returns an int32 scalar read when the op runs, not when the graph is built (a graph built
before ``init()`` or traced once reads the world it runs in), as Horovod's native ops do. They
are not differentiable and make no collective, so they take no place in the order of collective
nodes (:mod:`.bridge`).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from ringpipe.core import world as _w

__all__ = [
    "PROCESS_SET_ERROR_INIT",
    "check_num_rank_power_of_2",
    "PROCESS_SET_ERROR_UNKNOWN_SET",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "size_op",
]

#: Horovod's codes returned by ``process_set_included_op`` (``horovod/common/basics.py``).
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _query(read: Callable[[], int], name: str | None, default: str) -> tf.Tensor:
    if tf.executing_eagerly():
        return tf.constant(read(), tf.int32, name=name)
    out = tf.py_function(lambda: tf.constant(read(), tf.int32), [], tf.int32, name=name or default)
    out.set_shape([])
    return tf.stop_gradient(out)


def _set_size(process_set_id: int) -> int:
    world = _w.current()
    ps = world.sets.get(int(process_set_id))
    if ps is None or ps.ranks is None:
        raise ValueError(f"size_op: process set id {process_set_id} is unknown; known ids: {sorted(world.sets)}")
    return len(ps.ranks)


def _included(process_set_id: int) -> int:
    if not _w.is_initialized():
        return PROCESS_SET_ERROR_INIT
    world = _w.current()
    ps = world.sets.get(int(process_set_id))
    if ps is None or ps.ranks is None:
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(world.comm.rank in ps.ranks)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of processes in the process set ``process_set_id`` (0: all), read when the op runs."""
    return _query(lambda: _set_size(process_set_id), name, "RingpipeSize")


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes on this node, read when the op runs."""
    from ringpipe.core.basics import local_size

    return _query(local_size, name, "RingpipeLocalSize")


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, read when the op runs."""
    from ringpipe.core.basics import rank

    return _query(rank, name, "RingpipeRank")


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its node, read when the op runs."""
    from ringpipe.core.basics import local_rank

    return _query(local_rank, name, "RingpipeLocalRank")


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this process belongs to the set, 0 if not; Horovod's error codes otherwise.

    ``PROCESS_SET_ERROR_INIT`` (-1) before ``init()``, ``PROCESS_SET_ERROR_UNKNOWN_SET`` (-3) for
    an id that names no registered set.
    """
    return _query(lambda: _included(process_set_id), name, "RingpipeProcessSetIncluded")


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """True if ``num_rank`` is a power of two (1, 2, 4, ...), as Adasum needs; False for 0."""
    return num_rank > 0 and (num_rank & (num_rank - 1)) == 0
