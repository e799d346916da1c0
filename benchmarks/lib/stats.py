"""Medians, percentiles and spreads of benchmark samples, and ratios of paired ones.

A benchmark here compares ringpipe with a peer on one machine in one run; what it reports for a
pair is the median of the per-run (or per-block) ratios with their lowest and highest, since a
ratio taken block by block cancels the drift a shared machine puts on both sides alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Spread", "apart", "median", "percentile", "ratios", "spread"]


def median(values: Sequence[float]) -> float:
    """The median; refuses an empty sample rather than returning a made-up number."""
    if not values:
        raise ValueError("median of no samples: the benchmark timed nothing")
    return statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of no samples: the benchmark timed nothing")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """A sample's median with its low and high ends (min-max, or p10-p90: ``kind`` says which)."""

    median: float
    low: float
    high: float
    kind: str = "min-max"

    def fmt(self, digits: int = 3, scale: float = 1.0) -> str:
        """``median (low-high)``, each value multiplied by ``scale``."""
        m, lo, hi = (v * scale for v in (self.median, self.low, self.high))
        return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def spread(values: Sequence[float], kind: str = "min-max") -> Spread:
    """The median with min-max (``kind="min-max"``) or the 10th-90th percentiles (``"p10-p90"``)."""
    if kind == "min-max":
        return Spread(median(values), min(values), max(values), kind)
    if kind == "p10-p90":
        return Spread(median(values), percentile(values, 10), percentile(values, 90), kind)
    raise ValueError(f"unknown spread {kind!r}; valid: min-max, p10-p90")


def ratios(ours: Sequence[float], peer: Sequence[float]) -> Spread:
    """Paired ratios ``ours[i] / peer[i]`` (per run or per block): their median and min-max."""
    if len(ours) != len(peer):
        raise ValueError(f"paired samples differ in length: {len(ours)} against {len(peer)}")
    return spread([a / b for a, b in zip(ours, peer, strict=True)])


def apart(a: Spread, b: Spread) -> bool:
    """Whether two spreads do not overlap (otherwise a ratio of their medians is inconclusive)."""
    return a.high < b.low or b.high < a.low
