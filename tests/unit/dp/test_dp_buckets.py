"""Fusion buckets: which parameters share a bucket, in the order backward produces their gradients.

Parameters go into buckets last registered first; the first bucket is closed at
``first_bucket_bytes`` so that its reduction starts early in backward; and the parameters of the
first registered modules (whose gradients come last), whole modules up to ``first_bucket_bytes``,
get a bucket of their own at the end, so that little reduction is left when backward ends.
"""

from __future__ import annotations

import torch
from torch import nn

from ringpipe.dp.buckets import Slot, make_buckets


def layout(model: nn.Module, first: int, cap: int, tail: int) -> list[list[str]]:
    slots = [Slot(p, n) for n, p in model.named_parameters()]
    return [[s.name for s in b.slots] for b in make_buckets(slots, None, first, cap, tail_cap=tail)]


def mlp() -> nn.Module:
    # float32 sizes: 0: 4 KiB + 32 B, 1: 1 KiB + 32 B, 2: 1 KiB + 32 B, 3: 320 B + 40 B
    return nn.Sequential(nn.Linear(128, 8), nn.Linear(32, 8), nn.Linear(32, 8), nn.Linear(8, 10))


def test_without_a_tail_cap_the_last_bucket_holds_everything_after_the_first():
    assert layout(mlp(), first=300, cap=1 << 20, tail=0) == [
        ["3.bias", "3.weight"],
        ["2.bias", "2.weight", "1.bias", "1.weight", "0.bias", "0.weight"],
    ]


def test_the_first_modules_parameters_get_a_bucket_of_their_own_at_the_end():
    # the tail takes whole modules from the end until it holds tail_cap bytes
    assert layout(mlp(), first=300, cap=1 << 20, tail=300) == [
        ["3.bias", "3.weight"],
        ["2.bias", "2.weight", "1.bias", "1.weight"],
        ["0.bias", "0.weight"],
    ]
    assert layout(mlp(), first=300, cap=1 << 20, tail=5000) == [
        ["3.bias", "3.weight"],
        ["2.bias", "2.weight"],
        ["1.bias", "1.weight", "0.bias", "0.weight"],
    ]


def test_no_tail_where_it_would_take_the_whole_last_bucket_or_there_is_one_bucket():
    assert layout(mlp(), first=300, cap=1 << 20, tail=1 << 20) == [
        ["3.bias", "3.weight"],
        ["2.bias", "2.weight", "1.bias", "1.weight", "0.bias", "0.weight"],
    ]
    assert layout(mlp(), first=1 << 20, cap=1 << 20, tail=300) == [
        ["3.bias", "3.weight", "2.bias", "2.weight", "1.bias", "1.weight", "0.bias", "0.weight"],
    ]


def test_only_the_last_bucket_carries_the_map_of_parameters_with_gradients():
    slots = [Slot(p, n) for n, p in mlp().named_parameters()]
    buckets = make_buckets(slots, None, 300, 1 << 20, tail_cap=300)
    assert [b.bitmap for b in buckets] == [0, 0, len(slots)]
    assert all(b.buffer.dtype == torch.float32 for b in buckets)
