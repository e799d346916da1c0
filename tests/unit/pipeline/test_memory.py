"""A stage's memory: one micro-batch's footprint, the peak an action list implies, sizes and budgets.

Oracles are hand counts: a linear layer's saved input and a ReLU's saved output, bytes of
float32 tensors of known shapes, and the micro-batches a schedule holds, counted on its text.
"""

import pytest
import torch
from torch import nn

from ringpipe.pipeline.actions import parse
from ringpipe.pipeline.memory import (
    MemoryBudgetError,
    MicrobatchFootprint,
    microbatch_footprint,
    optimizer_state_bytes,
    parse_bytes,
    predict_stage,
)
from ringpipe.pipeline.memory_plan import ScheduleMemory, check_budget


def test_a_linear_relu_stage_holds_its_input_and_the_relu_output():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    x = torch.randn(3, 4)
    fp, out = microbatch_footprint(stage, x, first=False)
    # saved: the input (3x4, also the kept leaf) and ReLU's result (3x8, also the output sent on)
    assert fp.activations == 4 * (3 * 4 + 3 * 8)
    assert fp.kept_input == 4 * 3 * 4
    assert out[0].shape == (3, 8)


def test_parameters_are_not_activations():
    stage = nn.Sequential(nn.Linear(4, 4))
    fp, _ = microbatch_footprint(stage, torch.randn(2, 4), first=True)
    assert fp.activations == 4 * (2 * 4 + 2 * 4)  # input and output, not the 4x4 weight


def test_adam_keeps_two_moments_per_parameter_and_sgd_none():
    params = [nn.Parameter(torch.zeros(10, 10))]
    adam = optimizer_state_bytes(lambda ps: torch.optim.Adam(ps, lr=0.1), params)
    assert 2 * 400 <= adam <= 2 * 400 + 8  # exp_avg, exp_avg_sq (+ a scalar step)
    assert optimizer_state_bytes(lambda ps: torch.optim.SGD(ps, lr=0.1), params) == 0


FP = MicrobatchFootprint(activations=100, kept_input=10)


@pytest.mark.parametrize("text, held", [
    ("F0 F1 F2 F3 B0 B1 B2 B3 S", 4),           # gpipe holds every micro-batch
    ("F0 F1 B0 F2 B1 F3 B2 B3 S", 2),           # 1f1b, stage 0 of 2
    ("F0 B0 F1 B1 S", 1),                       # seq
])
def test_peak_is_the_most_micro_batches_held_plus_weights(text, held):
    got = predict_stage(parse(text), FP, param_bytes=10, optimizer_bytes=20)
    # gpipe peaks after its last forward, before any gradient exists; the others once one does
    grads = 10 if held < 4 else 0
    assert got.peak == 10 + 20 + held * 100 + grads
    assert got.in_flight == held


def test_recomputation_holds_only_the_inputs():
    got = predict_stage(parse("F0 F1 F2 B0 B1 B2 S"), FP, 0, 0, recompute=True)
    assert got.activations == 3 * 10


def test_split_backward_holds_until_w_and_adds_the_layer_gradients():
    fp = MicrobatchFootprint(activations=100, kept_input=10, split_extra=30)
    got = predict_stage(parse("F0 F1 B0 B1 W0 W1 S"), fp, 0, 0)
    assert got.activations == 2 * (100 + 30)


def test_weight_stashing_keeps_one_copy_per_stale_version():
    # stage 0 of 2, async 1F1B: F1, F2 and F3 each see a step before their backward (stale), each
    # on other weights; F2 runs while F1's stash is still held: two copies at once, never three
    acts = parse("F0 F1 B0 S F2 B1 S F3 B2 S B3 S")
    got = predict_stage(acts, FP, param_bytes=50, optimizer_bytes=0, stash="step")
    assert got.stashes == 2 * 50
    assert predict_stage(acts, FP, param_bytes=50, optimizer_bytes=0).stashes == 0  # stale: no stash


def test_sizes_read_in_binary_units():
    assert parse_bytes("2G") == 2 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5k") == 1536
    assert parse_bytes(1000) == 1000
    with pytest.raises(MemoryBudgetError, match="write it like"):
        parse_bytes("lots")


def test_a_budget_smaller_than_a_stage_is_refused_with_the_figures():
    plan = ScheduleMemory("gpipe", [predict_stage(parse("F0 F1 B0 B1 S"), FP, 10, 0)])
    check_budget(plan, 210)
    with pytest.raises(MemoryBudgetError, match=r"gpipe.*stage 0: 210 B \(activations 200 B for 2 micro-batches"):
        check_budget(plan, 209)
