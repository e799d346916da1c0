"""Per-micro-batch seeding: the draws of ``torch.manual_seed(seed)``, the outer generator sequence untouched."""

import torch

from ringpipe.pipeline.recompute import RngState, seeded


def test_seeded_draws_what_torch_manual_seed_draws_and_restores_the_outer_sequence():
    torch.manual_seed(11)
    expected_outer = torch.rand(3), torch.rand(3)
    torch.manual_seed(7)
    expected_inner = torch.rand(4), torch.bernoulli(torch.full((6,), 0.5))

    torch.manual_seed(11)
    first = torch.rand(3)
    with seeded(7):
        inner = torch.rand(4), torch.bernoulli(torch.full((6,), 0.5))
    second = torch.rand(3)
    assert torch.equal(first, expected_outer[0]) and torch.equal(second, expected_outer[1])
    assert all(torch.equal(a, b) for a, b in zip(inner, expected_inner, strict=True))


def test_seeded_with_none_draws_from_the_outer_sequence():
    torch.manual_seed(3)
    expected = torch.rand(5)
    torch.manual_seed(3)
    with seeded(None):
        got = torch.rand(5)
    assert torch.equal(got, expected)


def test_a_captured_state_replays_the_same_draws_and_leaves_the_sequence_going_on():
    torch.manual_seed(5)
    state = RngState.capture()
    first = torch.rand(4)
    after = torch.rand(2)
    torch.manual_seed(5)
    torch.rand(4)
    with state.replay():
        again = torch.rand(4)
    assert torch.equal(again, first)
    assert torch.equal(torch.rand(2), after)
