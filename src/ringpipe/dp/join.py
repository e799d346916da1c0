"""Join: a rank that has run out of data keeps serving the others' gradient reductions until all are done.

A joined rank repeats the collectives of one optimizer step with zero gradients and a zero
"has data" count in the first bucket, and applies the averaged gradients of the ranks that
still have data, so its parameters stay equal to theirs. When the count it receives is zero,
every rank has joined and all of them return together. While some rank is joined, the others
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
    :class:`~ringpipe.dp.optimizer.DistributedOptimizer` on ``comm`` (none: a plain barrier).
    Learning-rate schedulers are not advanced for the served steps.
    """
    engine = Engine.of(comm)
    optimizers = sorted(engine.optimizers, key=id)
    served = 0
    if optimizers:
        if len(optimizers) > 1:
            log.warning("join: %d DistributedOptimizers on %s; serving the newest one", len(optimizers), comm.name)
        optimizer = max(optimizers, key=lambda o: o._created)
        while optimizer._join_step():
            served += 1
    counts = engine.run(lambda: comm.allgather_object(served), name="join")
    fewest = min(counts)
    return max(r for r, c in enumerate(counts) if c == fewest)
