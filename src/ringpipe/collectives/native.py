"""The backend's own allreduce as an entry of the algorithm table, after ringpipe's header check.

``allreduce(..., algorithm="auto")`` that resolves to ``native`` does not come here: it takes the
very path of ``algorithm="native"`` (the communicator's own check and collective), so that it
costs what native costs. This entry serves callers that run a resolved algorithm from the table
on a context that has already exchanged ringpipe's header: the payload then travels through the
backend's collective on the whole buffer, unchecked a second time.
"""

from __future__ import annotations

import torch

from ringpipe.collectives.common import Ctx
from ringpipe.comm.base import ReduceOp

__all__ = ["allreduce"]


def allreduce(ctx: Ctx, flat: torch.Tensor) -> None:
    """Reduce ``flat`` in place with the backend's allreduce (Average: the caller divides after the sum)."""
    op = ReduceOp.SUM if ctx.op in (None, ReduceOp.AVERAGE) else ctx.op
    with ctx.comm.unchecked():
        ctx.comm.allreduce(flat, op)
