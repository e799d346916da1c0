"""The data-parallel sums' transport: two gloo ranks exchange small messages pairwise, bitwise equal to a + b.

The reference is the sum written in the test from both ranks' inputs (each rank can rebuild the
other's from the seed); which transport ran is read from the communication log (a pairwise
exchange is logged as an ``allreduce`` under its own tag).
"""

from __future__ import annotations

import pytest
import torch

from ringpipe.collectives.pairwise import ANNOUNCE_TAG, DATA_TAG, iallreduce_pair
from ringpipe.comm.base import ReduceOp
from ringpipe.dp.transport import PAIRWISE_BYTES, isum, pairwise
from ringpipe.launch import spawn

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 10).to(dtype)


def _tags(comm) -> list[int]:
    return [e.tag for e in comm.log.events() if e.op == "allreduce"]


def _sums(comm) -> list[tuple[str, bool, bool, list[int]]]:
    out = []
    for dtype in DTYPES:
        for n in (1, 1000, 17_226):
            comm.log.clear()
            x = _input(comm.rank, n, dtype)
            expected = _input(0, n, dtype) + _input(1, n, dtype)  # a + b == b + a in IEEE arithmetic
            got = isum(comm, x).wait()
            out.append((f"{dtype} {n}", got is x, torch.equal(x, expected), _tags(comm)))
    return out


def test_two_gloo_ranks_sum_small_floating_point_messages_by_one_exchange_bitwise_equal_to_a_plus_b():
    for rank_result in spawn(_sums, 2):
        for what, in_place, equal, tags in rank_result:
            assert in_place and equal, what
            assert tags == [DATA_TAG], what


def _average_and_fallbacks(comm) -> dict[str, object]:
    out: dict[str, object] = {}
    x = _input(comm.rank, 100, torch.float32)
    isum(comm, x, ReduceOp.AVERAGE).wait()
    out["average"] = torch.equal(x, (_input(0, 100, torch.float32) + _input(1, 100, torch.float32)) / 2)
    comm.log.clear()
    ints = torch.arange(10, dtype=torch.int64) * (comm.rank + 1)
    isum(comm, ints).wait()
    out["ints"] = (torch.equal(ints, torch.arange(10, dtype=torch.int64) * 3), _tags(comm))
    comm.log.clear()
    big = torch.ones(PAIRWISE_BYTES // 4 + 1) * (comm.rank + 1)
    isum(comm, big).wait()
    out["big"] = (bool((big == 3).all()), _tags(comm))
    base = torch.ones(8, 2) * (comm.rank + 1)
    strided = base[:, 0] if comm.rank == 1 else base[:, 0].contiguous()  # contiguity is each rank's own
    assert strided.is_contiguous() == (comm.rank == 0)
    isum(comm, strided).wait()
    out["strided"] = (bool((strided == 3).all()) and bool((base[:, 1] == comm.rank + 1).all()), None)
    comm.log.clear()
    mx = torch.full((5,), float(comm.rank))
    isum(comm, mx, ReduceOp.MAX).wait()
    out["max"] = (torch.equal(mx, torch.ones(5)), _tags(comm))
    return out


def test_integers_other_ops_and_messages_over_the_limit_take_the_backends_allreduce():
    for r in spawn(_average_and_fallbacks, 2):
        assert r["average"] is True
        assert r["strided"][0]
        for what in ("ints", "big", "max"):
            ok, tags = r[what]
            assert ok, what
            assert tags == [0], (what, tags)  # the backend's collective, not a tagged exchange


def _back_to_back(comm) -> bool:
    """Exchanges posted back to back, of different lengths and both tags, complete in any order of waiting."""
    xs = [torch.full((n,), float(comm.rank + 1) * n) for n in (3, 5000, 7, 100_000)]
    works = [isum(comm, x, tag=ANNOUNCE_TAG if i % 2 else DATA_TAG) for i, x in enumerate(xs)]
    for w in reversed(works):
        w.wait()
    return all(bool((x == 3.0 * x.numel()).all()) for x in xs)


def test_exchanges_posted_back_to_back_are_matched_in_posting_order():
    assert spawn(_back_to_back, 2) == [True, True]


def _three(comm) -> tuple[bool, bool, str]:
    x = torch.ones(10)
    chosen = pairwise(comm, x)
    isum(comm, x).wait()
    try:
        iallreduce_pair(comm, torch.ones(3))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return chosen, bool((x == 3).all()), refused


def test_three_ranks_take_the_backends_allreduce_and_the_pairwise_exchange_refuses_them():
    for chosen, ok, refused in spawn(_three, 3):
        assert chosen is False and ok
        assert "needs a communicator of 2 ranks" in refused and "has 3" in refused


@pytest.mark.parametrize("bad", ["int", "strided"])
def test_the_pairwise_exchange_refuses_what_it_cannot_sum(bad):
    def body(comm) -> str:
        t = torch.arange(4) if bad == "int" else torch.ones(4, 2)[:, 0]
        try:
            iallreduce_pair(comm, t)
        except ValueError as exc:
            return str(exc)
        return ""

    for msg in spawn(body, 2):
        assert ("torch.int64" in msg) if bad == "int" else ("non-contiguous" in msg)
