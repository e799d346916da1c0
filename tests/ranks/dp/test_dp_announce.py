"""Announcements that carry their allreduce: one message for a small Sum or Average, on every rank alike.

Specification: before every data-parallel collective the ranks allreduce a header (the cross-rank
check, and what joined ranks need to take part). A Sum or Average allreduce of float32, float16
or bfloat16 that fits the header's payload area travels inside that same message, so it costs
one round trip, not two; the area grows (in step on every rank, from the summed header) to the
length of an allreduce too long for it, up to ``GROW_CAP`` elements. Results are the formula's
(the sum over ranks of each rank's prescaled tensor, divided by the size for Average, then
postscaled), joined ranks contribute zeros, and ranks whose calls differ all raise with the
tensor untouched. The expected values here are written from those formulas.
"""

from __future__ import annotations

import pytest
import torch

from ringpipe.comm.base import ReduceOp


def _allreduces(comm):  # noqa: ANN001
    """Each case twice: the first call may grow the area, the second rides; messages counted per call."""
    from ringpipe.comm.events import default_log
    from ringpipe.core.ops import allreduce_inplace

    r, out = comm.rank, []
    cases = [
        ("sum32", torch.float32, ReduceOp.SUM, 1.0, 1.0, 5),
        ("avg32", torch.float32, ReduceOp.AVERAGE, 1.0, 1.0, 1000),
        ("avg16", torch.float16, ReduceOp.AVERAGE, 1.0, 1.0, 7),
        ("sumbf16", torch.bfloat16, ReduceOp.SUM, 1.0, 1.0, 33),
        ("scaled", torch.float32, ReduceOp.AVERAGE, 0.5, 3.0, 9),
        ("max", torch.float32, ReduceOp.MAX, 1.0, 1.0, 9),
        ("int", torch.int32, ReduceOp.SUM, 1.0, 1.0, 9),
        ("long", torch.float32, ReduceOp.SUM, 1.0, 1.0, 70000),  # longer than the area may grow
    ]
    for label, dtype, op, pre, post, n in cases:
        for attempt in range(2):
            values = (torch.arange(n, dtype=torch.float64) % 7 + r + 1).to(dtype)
            default_log().clear()
            got = allreduce_inplace(comm, values.clone(), op, pre, post)
            messages = [e for e in default_log().events() if e.op == "allreduce" and e.comm == comm.name]
            out.append((label, attempt, got.double().tolist(), len(messages),
                        any(e.detail.get("negotiated") for e in messages)))
    return out


def _expected(label: str, n: int, size: int) -> list[float]:
    per_rank = [[(i % 7) + r + 1.0 for i in range(n)] for r in range(size)]
    if label == "max":
        return [max(col) for col in zip(*per_rank, strict=True)]
    if label == "scaled":
        return [sum(0.5 * v for v in col) / size * 3.0 for col in zip(*per_rank, strict=True)]
    total = [sum(col) for col in zip(*per_rank, strict=True)]
    return [t / size for t in total] if label.startswith("avg") else total


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_small_sum_or_average_is_one_message_once_the_area_fits_it(worlds, ranks):
    sizes = {"sum32": 5, "avg32": 1000, "avg16": 7, "sumbf16": 33, "scaled": 9, "max": 9, "int": 9, "long": 70000}
    for rank_out in worlds.spawn(_allreduces, ranks):
        for label, attempt, got, messages, negotiated in rank_out:
            want = _expected(label, sizes[label], ranks)
            tol = 1e-2 if label in ("avg16", "sumbf16") else 1e-6
            assert got == pytest.approx(want, rel=tol), (label, attempt)
            if label in ("max", "int", "long"):
                # not a sum of floats that fits: the header, then the data
                assert (messages, negotiated) == (2, False), (label, attempt, messages)
            elif attempt == 1:
                assert (messages, negotiated) == (1, True), (label, attempt, messages)
        # the first sum of each length grew the area; the second of "avg32" fits the area it grew
        firsts = {label: m for label, attempt, _, m, _ in rank_out if attempt == 0}
        assert firsts["sum32"] == 2 and firsts["avg32"] == 2
        assert firsts["avg16"] == firsts["sumbf16"] == firsts["scaled"] == 1  # within the 1000 grown before


def _joined_serves_riding_allreduces(comm):  # noqa: ANN001
    """The last rank joins at once; the others allreduce small tensors, which ride."""
    from ringpipe.core.ops import allreduce_inplace
    from ringpipe.dp.join import join

    if comm.rank == comm.size - 1:
        return ("joined", join(comm))
    got = []
    for k in range(4):
        t = torch.full((10,), float(comm.rank + 1 + k))
        got.append(allreduce_inplace(comm, t, ReduceOp.AVERAGE if k % 2 else ReduceOp.SUM).tolist())
    return ("data", got, join(comm))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_joined_rank_contributes_zeros_to_allreduces_riding_in_announcements(worlds, ranks):
    for out in worlds.spawn(_joined_serves_riding_allreduces, ranks):
        if out[0] == "joined":
            continue
        _, got, _ = out
        for k, values in enumerate(got):
            total = sum(r + 1 + k for r in range(ranks - 1))  # the joined rank adds zeros
            want = total / ranks if k % 2 else total  # Average divides by the full size, as Horovod
            assert values == pytest.approx([want] * 10), k


def _differing_calls(comm):  # noqa: ANN001
    """Both calls fit the area, but the ranks' shapes differ: every rank raises, tensors untouched."""
    from ringpipe.check.announcement import checks
    from ringpipe.core.engine import Engine
    from ringpipe.core.ops import allreduce_inplace, reduce_announced

    allreduce_inplace(comm, torch.ones(8), ReduceOp.SUM)  # grows the area to 8
    allreduce_inplace(comm, torch.ones(8), ReduceOp.SUM)
    mine = torch.full((4 + comm.rank % 2,), 5.0)
    before = mine.clone()
    try:  # the in-place form, which could write into the tensor
        Engine.of(comm).run(lambda: reduce_announced(comm, mine, ReduceOp.SUM, ReduceOp.SUM, 1.0, None,
                                                     checks(comm, "allreduce", mine)))
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = str(exc)
    after = torch.full((2,), float(comm.rank))
    allreduce_inplace(comm, after, ReduceOp.SUM)  # the communicator goes on
    return error, torch.equal(mine, before), after.tolist()


@pytest.mark.timeout(180)
def test_ranks_whose_riding_calls_differ_all_raise_and_leave_the_tensor_untouched(worlds):
    for error, untouched, after in worlds.spawn(_differing_calls, 2):
        assert error is not None and "shape" in error, error
        assert untouched
        assert after == [1.0, 1.0]
