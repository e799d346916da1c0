"""Join: a rank that has run out of data keeps serving the others' gradient reductions until all are done.

A joined rank repeats the collectives of one optimizer step with zero gradients and a zero
"has data" count in the first bucket, and applies the averaged gradients of the ranks that
still have data, with their hyper-parameters (a learning-rate scheduler on the joined rank
no longer advances, so the learning rate of each served step is taken from a rank with data),
so its parameters stay equal to theirs. When the count it receives is zero, every rank has
joined and all of them return together, with the hyper-parameters of the rank that joined last. While some rank is joined, the others
may run only DistributedOptimizer steps (no other collective) until they join too.
"""

from __future__ import annotations

import logging

from ringpipe.comm.base import Communicator
from ringpipe.dp.engine import Engine

__all__ = ["join"]

log = logging.getLogger(__name__)


def join(comm: Communicator) -> int:
    """Block until every rank has called ``join``; return the rank that joined last.

    Serves the optimizer steps of ranks with data meanwhile, using the most recently created
    :class:`~ringpipe.dp.optimizer.DistributedOptimizer` on ``comm`` (none: a plain barrier),
    with the hyper-parameters of a rank with data. On return every rank's optimizer has the
    hyper-parameters of the rank that joined last. A learning-rate scheduler keeps its own step
    count, which on an early rank missed the served steps: to continue with it, load the last
    rank's state, e.g. ``sched.load_state_dict(broadcast_object(sched.state_dict(), last))``.
    """
    engine = Engine.of(comm)
    optimizers = sorted(engine.optimizers, key=id)
    served = 0
    optimizer = None
    if optimizers:
        if len(optimizers) > 1:
            log.warning("join: %d DistributedOptimizers on %s; serving the newest one", len(optimizers), comm.name)
        optimizer = max(optimizers, key=lambda o: o._created)
        while optimizer._join_step():
            served += 1
    mine = (served, optimizer.hyperparameters() if optimizer is not None else None)
    every = engine.run(lambda: comm.allgather_object(mine), name="join")
    fewest = min(c for c, _ in every)
    last = max(r for r, (c, _) in enumerate(every) if c == fewest)
    if optimizer is not None and every[last][1] is not None:
        optimizer.load_hyperparameters(every[last][1])
    return last
