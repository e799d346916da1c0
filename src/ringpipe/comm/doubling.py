"""The recursive doubling pattern for any number of ranks: who talks to whom, step by step.

Shared by the consistency check of every collective (headers travel along it) and by
ringpipe's recursive-doubling allreduce (which carries small payloads along it).
"""

from __future__ import annotations

__all__ = ["doubling_steps", "new_rank", "real_rank"]


def doubling_steps(rank: int, size: int) -> list[tuple[str, int, int]]:
    """The recursive doubling pattern for any size, as ``(kind, peer, step)`` triples.

    With ``p2`` the largest power of two <= size and ``rem = size - p2``, the even ranks below
    ``2 rem`` first hand their data to the next odd rank (``send``, step 0) and get the result
    back at the end (``recv_result``, step ``lg p2 + 1``); the odd ones reduce it (``recv``) and
    return the result (``send_result``); the ``p2`` core ranks exchange with partners at
    distance 1, 2, 4, ... (steps 1 .. lg p2). Both sides of a message agree on its step.
    """
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    last = p2.bit_length()
    if rank < 2 * rem and rank % 2 == 0:
        return [("send", rank + 1, 0), ("recv_result", rank + 1, last)]
    steps: list[tuple[str, int, int]] = []
    if rank < 2 * rem:
        steps.append(("recv", rank - 1, 0))
    new = new_rank(rank, size)
    assert new is not None
    dist, step = 1, 1
    while dist < p2:
        steps.append(("exchange", real_rank(new ^ dist, size), step))
        dist <<= 1
        step += 1
    if rank < 2 * rem:
        steps.append(("send_result", rank - 1, last))
    return steps


def new_rank(rank: int, size: int) -> int | None:
    """The rank among the ``p2`` core ranks of :func:`doubling_steps` (None for folded ranks)."""
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else None
    return rank - rem


def real_rank(new: int, size: int) -> int:
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    return 2 * new + 1 if new < rem else new + rem
