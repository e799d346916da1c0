"""Timing variants against each other in alternating blocks, after a warm-up.

On a shared machine the load drifts during a run; timing all of one variant and then all of the
other puts the drift on one side. Here every variant runs a block of ``steps`` calls in turn, the
order rotated from block to block and reversed every other round (``order``), so drift falls on
every variant alike. ``barrier`` (a communicator's) lines the ranks up before each block, as the
ranks of a data-parallel job start a step together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["alternate", "order", "timed"]


def order(names: Sequence[str], block: int) -> list[str]:
    """The variants' order in block ``block``: rotated by one each block, reversed every other round."""
    names = list(names)
    if not names:
        return names
    k = block % len(names)
    turn = names[k:] + names[:k]
    return turn if (block // len(names)) % 2 == 0 else turn[::-1]


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn`` (wall clock, ``perf_counter``)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def alternate(variants: Mapping[str, Callable[[], object]], blocks: int, steps: int, warmup: int = 1,
              barrier: Callable[[], object] | None = None) -> dict[str, list[list[float]]]:
    """Time every variant in ``blocks`` alternating blocks of ``steps`` calls after ``warmup`` calls each.

    Returns, per variant, one list of call times per block (``[block][call]``), so that a caller can
    take per-block medians and pair them across variants (:func:`lib.stats.ratios`).
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[list[float]]] = {name: [] for name in variants}
    for block in range(blocks):
        for name in order(list(variants), block):
            if barrier is not None:
                barrier()
            out[name].append(timed(variants[name], steps))
    return out
