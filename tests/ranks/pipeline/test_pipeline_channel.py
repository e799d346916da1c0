"""The channels between neighbour stages keep a bounded number of sends alive, however long the stream."""

import pytest
import torch
from torch import nn

from ringpipe.pipeline import PipelineTrainer

BATCHES, MICRO = 60, 2  # 120 micro-batches through a stream that stays open until drain
LIMIT = 64  # outstanding sends a channel keeps before it waits for the oldest


def _outstanding_sends(comm):
    torch.manual_seed(0)
    t = PipelineTrainer(
        comm, [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)], balance=[2, 1], schedule="async", microbatches=MICRO,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01), loss_fn=nn.functional.mse_loss,
    )
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    sends = (t.executor.act_out or t.executor.grad_out).sends
    peak = 0
    for _ in range(BATCHES):
        t.stream_step(x if t.is_first else None, y if t.is_last else None)
        peak = max(peak, len(sends.works))
    t.drain()
    return peak, len(sends.works)


@pytest.mark.timeout(600)
def test_an_open_stream_does_not_keep_every_send(worlds):
    """gloo reports a send complete only once waited for: the channel waits for the oldest beyond its limit."""
    for peak, left in worlds.spawn(_outstanding_sends, 2):
        assert BATCHES * MICRO > LIMIT + 1  # without the limit every send (and its tensor) would stay
        assert peak <= LIMIT
        assert left == 0  # drain waits for the rest
