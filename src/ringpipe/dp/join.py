"""Join: a rank that has run out of data keeps serving the others' collectives until all are done.

Every data-parallel collective is announced by a small header (:mod:`ringpipe.check.announcement`).
A joined rank repeats header exchanges with a zero contribution and acts on what the ranks with
data announce: for an optimizer step it reduces zero gradients and then applies the reduced
gradients (an Average divides by the full size, as in Horovod), with their hyper-parameters (its own learning-rate scheduler
no longer advances), so its parameters stay equal to theirs; for an allreduce (SyncBatchNorm's
statistics, a metric) it contributes the identity of the reduce op; it takes part in barriers.
Gradients that the ranks with data change after ``synchronize()`` (clipping) are not what a
joined rank applies: when every rank has joined, ranks whose parameters then differ take those
of the rank that joined last, with its optimizer state.
Any other collective raises :class:`~ringpipe.core.errors.JoinError` on the ranks that called it
(Horovod's "... is not supported with Join at this time."), while joined ranks go on. When a
header shows no rank with data, every rank has joined and all of them return together.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ringpipe.check.announcement import Note, device_of, exchange, identity, rides
from ringpipe.comm.base import Communicator
from ringpipe.core.calls import Call
from ringpipe.core.engine import Engine
from ringpipe.core.errors import JoinError
from ringpipe.core.ops import finish_reduction, start_reduction
from ringpipe.core.process_sets import ProcessSet, global_process_set

__all__ = ["join", "join_process_set", "JoinError"]

log = logging.getLogger(__name__)


def join_process_set(process_set: ProcessSet = global_process_set) -> int:
    """Horovod's ``hvd.join`` on ``process_set`` (every face's): :func:`join` on its communicator.

    Returns the world rank of the rank that joined last.
    """
    call = Call("join", process_set, None)
    return call.ranks[join(call.comm)]


def join(comm: Communicator) -> int:
    """Block until every rank has called ``join``; return the rank that joined last.

    Meanwhile serves the collectives of the ranks with data (see the module docstring); their
    optimizer steps go through the most recently created
    :class:`~ringpipe.dp.optimizer.DistributedOptimizer` on ``comm``. On return every rank's
    optimizer has the hyper-parameters of the rank that joined last. A learning-rate scheduler
    keeps its own step count, which on an early rank missed the served steps: to continue with
    it, load the last rank's state, e.g. ``sched.load_state_dict(broadcast_object(sched.state_dict(), last))``.
    """
    engine = Engine.of(comm)
    optimizers = list(engine.optimizers)
    optimizer = None
    if optimizers:
        if len(optimizers) > 1:
            log.warning("join: %d DistributedOptimizers on %s; serving the newest one", len(optimizers), comm.name)
        optimizer = max(optimizers, key=lambda o: o.serial)
        if not optimizer.join_support:
            raise JoinError(
                f"join on rank {comm.rank}: the DistributedOptimizer was built with join_support=False, so the ranks "
                "with data do not announce their steps and this rank could not serve them; build it with "
                "join_support=True (the default) on every rank to train on uneven data"
            )
    served = 0
    while True:
        note = engine.run(lambda: exchange(comm, None), name="join")
        if not note.have_data:
            break
        served += 1
        if note.op in ("step", "bucket", "apply"):
            if optimizer is None:
                raise JoinError(
                    f"join on rank {comm.rank}: rank {note.have_data[0]} ran an optimizer step but this rank has no "
                    "DistributedOptimizer to serve it with; build the same DistributedOptimizer on every rank"
                )
            optimizer.serve(note)
        elif note.op == "allreduce":
            _serve_allreduce(comm, engine, note)
        elif note.op == "barrier":
            engine.run(comm.barrier, name="join-barrier")
        # any other collective raises JoinError on the ranks that called it; this rank goes on waiting
    mine = (served, optimizer.hyperparameters() if optimizer is not None else None)
    every = engine.run(lambda: comm.allgather_object(mine), name="join")
    fewest = min(c for c, _ in every)
    last = max(r for r, (c, _) in enumerate(every) if c == fewest)
    if optimizer is not None and every[last][1] is not None:
        optimizer.load_hyperparameters(every[last][1])
    if optimizer is not None and _served(every):
        _agree_with(comm, engine, optimizer, last)
    return last


def _served(every: list[tuple[int, Any]]) -> bool:
    """Whether some rank served steps of the others (it joined with fewer steps than another)."""
    return len({count for count, _ in every}) > 1


def _agree_with(comm: Communicator, engine: Engine, optimizer: Any, last: int) -> None:
    """Give every rank the parameters and optimizer state of ``last`` where serving left them different.

    A joined rank applies the averaged gradients as reduced. Ranks with data that change their
    gradients between ``synchronize()`` and ``step()`` (clipping them, say) apply something
    else, so after join the ranks would train on from different weights. A digest of the
    parameters (sum and absolute sum of each, one small allgather) finds that case; then the
    rank that joined last, which had data at every step, sends its parameters and optimizer state.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return
    with torch.no_grad():
        digest = torch.stack([t for p in params for t in (p.double().sum(), p.double().abs().sum())]).cpu()
    digests = engine.run(lambda: comm.allgather_object(digest.tolist()), name="join-agree")
    if all(d == digests[last] for d in digests):
        return
    differ = [r for r, d in enumerate(digests) if d != digests[last]]
    log.info("join: parameters of rank(s) %s differ from those of rank %d after the served steps (gradients "
             "changed between synchronize() and step(), e.g. clipped); taking rank %d's parameters and "
             "optimizer state", differ, last, last)
    from ringpipe.dp.broadcast import broadcast_optimizer_state, broadcast_tensors

    broadcast_tensors(params, last, comm)
    broadcast_optimizer_state(optimizer, last, comm)


def _serve_allreduce(comm: Communicator, engine: Engine, note: Note) -> None:
    if note.reduce_op is None or note.dtype is None:
        return  # a dtype a joined rank cannot stand in for: the ranks with data raised (announce)
    rop = note.reduce_op
    area = 0 if note.payload is None else note.payload.numel()
    if rides(comm, rop, note.dtype, note.numel, note.cuda, area):
        return  # the data rode in the announcement, where this rank's area was zeros
    contribution = identity(rop, note.dtype, note.numel, device_of(comm, note))
    # Every announced allreduce is non-blocking: MPI does not match a blocking one with it.
    engine.run(lambda: finish_reduction(start_reduction(comm, contribution, rop)), name="join-allreduce")
