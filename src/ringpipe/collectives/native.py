"""The backend's own allreduce as one of ``auto``'s choices, after ringpipe's header check.

``algorithm="native"`` asked for by name runs the communicator's collective with the
communicator's own check. When ``auto`` picks the native collective from measurements, the call
has already gone through ringpipe's header exchange (it names the requested ``auto``, so ranks
that resolve ``auto`` differently still agree or fail together); the payload then travels through
the backend's collective on the whole buffer, unchecked a second time.
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
