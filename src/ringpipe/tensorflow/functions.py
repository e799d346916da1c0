"""Variables and Python objects across ranks: ``broadcast_variables``, ``broadcast_``, objects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from ringpipe.check.announcement import announce, checks
from ringpipe.core import movement as _movement
from ringpipe.core.calls import Call
from ringpipe.core.process_sets import ProcessSet, global_process_set, set_root
from ringpipe.dp.broadcast import broadcast_tensors

from .bridge import graph_op, run, to_tf, to_torch

__all__ = ["allgather_object", "broadcast_", "broadcast_object", "broadcast_object_fn", "broadcast_variables"]


def _broadcast_values(values: Sequence[tf.Tensor], root_rank: int, process_set: ProcessSet) -> list[tf.Tensor]:
    """``root_rank``'s values of every tensor: announced once (with every shape and dtype), one message per dtype."""
    call = Call("broadcast", process_set, None)
    root, problem = set_root(call.ranks, root_rank, "broadcast_variables")
    refused: BaseException | None = problem
    try:
        copies = [to_torch(v).clone() for v in values]  # written by the broadcast: never a TF buffer
    except TypeError as exc:  # a dtype no collective takes: refused on every rank by the announcement
        copies, refused = [], problem or exc
    layout = [[str(t.dtype).removeprefix("torch."), *t.shape] for t in copies]
    detail = {**call.detail, "root_rank": root_rank, "variables": layout}
    call.engine.run(lambda: announce(call.comm, "broadcast", detail=detail,
                                     validate=checks(call.comm, "broadcast_variables", root=root,
                                                     problem=refused)),
                    name="broadcast_variables")
    broadcast_tensors(copies, root, call.comm, announced=True)
    return [to_tf(t) for t in copies]


@graph_op
def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[Any]:
    """Overwrite ``variables`` with ``root_rank``'s values in place; returns their new values."""
    variables = list(variables)
    if not variables:
        return []
    values = [tf.convert_to_tensor(v) for v in variables]
    new = run(lambda *vs: _broadcast_values(vs, root_rank, process_set), values, [v.dtype for v in values],
              [v.shape for v in values], name="RingpipeBroadcastVariables")
    assigns = [var.assign(value) for var, value in zip(variables, new, strict=True)]
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies([a for a in assigns if hasattr(a, "op")]):
        return [tf.identity(v) for v in new]


@graph_op
def broadcast_variables(variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Give every rank ``root_rank``'s values of ``variables`` (Horovod step 5).

    Takes TF and Keras 3 variables (``model.variables``, ``optimizer.variables``); every rank
    must pass the same shapes and dtypes in the same order, or every rank raises.
    """
    return broadcast_(variables, root_rank, process_set=process_set)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s object (pickled) on every rank of the set."""
    return _movement.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's object (pickled), in rank order of the set."""
    return _movement.allgather_object(obj, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Any:
    """A function ``fn(obj)`` that returns ``root_rank``'s object on every rank (Horovod's TF1 form, eager here)."""

    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return fn
