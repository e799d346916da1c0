"""Specification of timing layers for a balance: each layer is timed as a pipeline stage runs it."""

from __future__ import annotations

import torch
from torch import nn

from ringpipe.pipeline.partition import balance_by_size, layer_times


class Probe(nn.Module):
    """A layer that records whether its input required grad (whether its backward computes one)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.requires_grad)
        return x * self.scale


def test_first_layer_is_timed_without_the_input_gradient_the_first_stage_never_computes():
    layers = [Probe(), Probe(), Probe()]
    times = layer_times(layers, torch.randn(4, 3), repeats=3)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert layers[0].seen == [False] * 3  # a data batch does not require grad
    assert layers[1].seen == [True] * 3 and layers[2].seen == [True] * 3  # a stage input does
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_a_sample_that_requires_grad_is_timed_with_its_input_gradient_and_left_untouched():
    layers = [Probe(), Probe()]
    sample = torch.randn(4, 3, requires_grad=True)
    layer_times(layers, sample, repeats=2)
    assert layers[0].seen == [True, True]
    assert sample.grad is None


def test_clock_is_the_one_given():
    ticks = iter(range(100))
    times = layer_times([Probe(), Probe()], torch.randn(2, 2), repeats=1, clock=lambda: float(next(ticks)))
    assert times == [1.0, 1.0]  # each layer: one tick between the two readings


def test_measured_costs_feed_the_exact_splitter():
    # stage 0 = layers 0..1 (2 + 3), stage 1 = layers 2..3 (3 + 3): the largest part, 6, is minimal
    assert balance_by_size([2.0, 3.0, 3.0, 3.0], 2) == [2, 2]
    assert balance_by_size([2.0, 3.0, 3.0, 3.0, 0.5], 2) == [2, 3]
