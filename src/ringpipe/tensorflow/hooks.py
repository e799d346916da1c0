"""TensorFlow 1 graphs: ``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook`` (Horovod's TF1 step 5).

A ``tf.compat.v1`` program builds a graph and trains it in a ``MonitoredTrainingSession``; the
hook adds one op that gives every rank ``root_rank``'s values of the graph's global variables
and runs it once the session has initialised them, as Horovod's hook does. The op is
:func:`.functions.broadcast_` over all of them (one announced broadcast).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ringpipe.core.process_sets import ProcessSet, global_process_set

from .functions import broadcast_

__all__ = ["BroadcastGlobalVariablesHook", "broadcast_global_variables"]


def broadcast_global_variables(root_rank: int, process_set: ProcessSet = global_process_set) -> Any:
    """An op that assigns ``root_rank``'s values to every global variable of the default graph.

    Graph mode only, as in Horovod: eager TensorFlow has no global variables (use
    ``broadcast_variables(model.variables, root_rank)``).
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution: there are no "
                           "global variables. Use hvd.broadcast_variables(<model/optimizer variables>, root_rank)")
    variables = tf.compat.v1.global_variables()
    if not variables:
        return tf.no_op(name="RingpipeBroadcastGlobalVariables")
    return tf.group(*broadcast_(variables, root_rank, process_set=process_set),
                    name="RingpipeBroadcastGlobalVariables")


_Hook: Any = tf.compat.v1.train.SessionRunHook


class BroadcastGlobalVariablesHook(_Hook):
    """A ``SessionRunHook`` that broadcasts the global variables from ``root_rank`` when the session starts.

    Use it with ``tf.compat.v1.train.MonitoredTrainingSession(hooks=[...])`` (or any session
    that runs hooks), so that every rank starts from the same weights, whether they come from a
    random initialisation or from a checkpoint restored on ``root_rank``.
    """

    def __init__(self, root_rank: int, device: str = "", process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank, self.process_set)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
