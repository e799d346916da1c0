"""Hierarchical allreduce: reduce inside each node, allreduce among node leaders, broadcast back.

Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``. Only one rank per node talks across nodes, so a
placement such as 4-3-1 ranks per node no longer drags every ring step down to the pace of
the busiest node's link (the anomaly of seed 000). Node membership comes from the
communicator's topology (hostnames gathered at init); the node and leader communicators are
created on first use (a collective call) and cached by the communicator.
"""

from __future__ import annotations

import torch

from ringpipe.collectives import recursive_doubling, ring, tree
from ringpipe.collectives.auto import SMALL_BYTES
from ringpipe.collectives.common import Ctx
from ringpipe.comm.base import Communicator

__all__ = ["allreduce"]

def _sub(ctx: Ctx, comm: Communicator) -> Ctx:
    return Ctx(comm, ctx.coll, ctx.seq, ctx.op, ctx.algo, False, ctx.call, ctx.device)


def allreduce(ctx: Ctx, x: torch.Tensor) -> None:
    """Allreduce the flat ``x`` in place (headers were checked on the whole communicator)."""
    comm = ctx.comm
    node = comm.node_comm()
    leaders = comm.leaders_comm()
    if node.size > 1:
        tree.reduce(_sub(ctx, node), x, 0)
    if leaders is not None and leaders.size > 1:
        small = x.numel() * x.element_size() <= SMALL_BYTES
        (recursive_doubling if small else ring).allreduce(_sub(ctx, leaders), x)
    if node.size > 1:
        tree.broadcast(_sub(ctx, node), x, 0)
