"""What ``ringpipe bench`` prints and draws: rows, per-size comparisons against native, busbw plots.

A comparison claims that one variant is faster or slower than the backend's own collective only
when their spreads over the interleaved rounds do not overlap (min-max over the rounds); where
they overlap it says so (``inconclusive``) and gives the ratio of the medians alone. Beside it,
the *paired* ratio: native's time over the variant's within each round (blocks that ran next to
each other, so a drift of the machine weighs on both), as median and interquartile range.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["compare", "format_comparison", "format_row", "format_summary", "format_table", "plot", "plot_figure"]

_HEAD = (f"{'size(B)':>11} {'count':>10} {'dtype':>8} {'algorithm':>24} {'min(us)':>10} "
         f"{'median(us)':>10} {'max(us)':>10} {'algbw':>8} {'busbw':>8} {'wrong':>6}")


def _label(r: dict[str, Any]) -> str:
    chosen = r.get("chosen", r["algorithm"])
    return r["algorithm"] if chosen == r["algorithm"] else f"{r['algorithm']}>{chosen}"


def format_row(r: dict[str, Any]) -> str:
    """One measured row: time per call over the rounds (min, median, max), bandwidths of the median."""
    return (f"{r['bytes']:>11} {r['count']:>10} {r['dtype']:>8} {_label(r):>24} "
            f"{r['time_min_us']:>10.1f} {r['time_us']:>10.1f} {r['time_max_us']:>10.1f} "
            f"{r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f} {r['wrong']:>6}")


def format_table(rows: list[dict[str, Any]]) -> str:
    return "\n".join([_HEAD, *(format_row(r) for r in rows)])


def _verdict(row: dict[str, Any], native: dict[str, Any]) -> str:
    """faster / slower than native when the min-max spreads are apart, else inconclusive."""
    if row["time_max_us"] < native["time_min_us"]:
        return "faster"
    if row["time_min_us"] > native["time_max_us"]:
        return "slower"
    return "inconclusive"


def _paired(variant: dict[str, Any], native: dict[str, Any]) -> list[float] | None:
    """Median, first and third quartile of native / variant time within each round (None without them)."""
    a, b = native.get("times_us"), variant.get("times_us")
    if not a or not b or len(a) != len(b) or min(b) <= 0:
        return None
    ratios = [n / v for n, v in zip(a, b, strict=True)]
    q1 = q3 = statistics.median(ratios)
    if len(ratios) >= 2:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return [round(statistics.median(ratios), 3), round(q1, 3), round(q3, 3)]


def compare(size_rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Ratios against native for one size's rows (None without a native row and another one).

    ``best``: the fastest of ringpipe's own algorithms by median; ``*_ratio``: native's median time
    over the variant's (above 1: faster than native, as a busbw ratio); ``*_verdict``: faster,
    slower or inconclusive (the min-max spreads over the rounds overlap); ``*_paired``: the
    per-round ratios' [median, first quartile, third quartile], when the rows carry ``times_us``.
    """
    by = {r["algorithm"]: r for r in size_rows}
    native = by.get("native")
    if native is None or len(by) < 2:
        return None
    out: dict[str, Any] = {"summary": True, "bytes": native["bytes"], "backend": native["backend"],
                           "ranks": native["ranks"], "native_us": native["time_us"]}
    own = [r for r in size_rows if r["algorithm"] not in ("native", "auto")]
    if own:
        best = min(own, key=lambda r: r["time_us"])
        out.update(best=best["algorithm"], best_us=best["time_us"],
                   best_ratio=round(native["time_us"] / best["time_us"], 3),
                   best_verdict=_verdict(best, native), best_paired=_paired(best, native))
    auto = by.get("auto")
    if auto is not None:
        out.update(auto_chose=auto.get("chosen", "?"), auto_us=auto["time_us"],
                   auto_ratio=round(native["time_us"] / auto["time_us"], 3),
                   auto_verdict=_verdict(auto, native), auto_paired=_paired(auto, native))
    return out


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else \
        f"{n >> 10} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} B"


def _pair_text(p: list[float] | None) -> str:
    return f", paired {p[0]:.2f}x (IQR {p[1]:.2f}-{p[2]:.2f})" if p else ""


def format_comparison(c: dict[str, Any]) -> str:
    """One line: best own algorithm / native and auto / native at one size, with the verdicts."""
    parts = [f"# {_size(c['bytes'])}:"]
    if "best" in c:
        parts.append(f"best own ({c['best']}) / native {c['best_ratio']:.2f}x [{c['best_verdict']}"
                     f"{_pair_text(c.get('best_paired'))}];")
    if "auto_chose" in c:
        parts.append(f"auto ({c['auto_chose']}) / native {c['auto_ratio']:.2f}x [{c['auto_verdict']}"
                     f"{_pair_text(c.get('auto_paired'))}]")
    return " ".join(parts).rstrip(";")


def format_summary(comparisons: list[dict[str, Any]]) -> str:
    """The per-size comparisons as one table (ratios are native time over the variant's, medians)."""
    head = (f"{'size':>8} {'native us':>10} {'best own':>18} {'best/nat':>8} {'verdict':>12} "
            f"{'auto chose':>18} {'auto/nat':>8} {'verdict':>12} {'auto/nat paired (IQR)':>22}")
    lines = [head]
    for c in comparisons:
        lines.append(f"{_size(c['bytes']):>8} {c['native_us']:>10.1f} {c.get('best', '-'):>18} "
                     f"{c.get('best_ratio', float('nan')):>8.2f} {c.get('best_verdict', '-'):>12} "
                     f"{c.get('auto_chose', '-'):>18} {c.get('auto_ratio', float('nan')):>8.2f} "
                     f"{c.get('auto_verdict', '-'):>12} {_iqr(c.get('auto_paired')):>22}")
    return "\n".join(lines)


def _iqr(p: list[float] | None) -> str:
    return f"{p[0]:.2f} ({p[1]:.2f}-{p[2]:.2f})" if p else "-"


def _human_size(n: float) -> str:
    for unit in ("", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:g}{unit}"
        n /= 1024
    return f"{n:g}G"


def plot_figure(rows: list[dict[str, Any]]) -> Any:
    """busbw against size, one line per algorithm: both axes logarithmic, sizes labelled 4K, 1M, ... (nccl-tests' way)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        pts = [(r["bytes"], r["busbw_gbps"]) for r in rows if r["algorithm"] == algo]
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=algo)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _human_size(x)))
    if any(r["busbw_gbps"] > 0 for r in rows):
        ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, log scale)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    first = rows[0] if rows else {"collective": "?", "backend": "?", "ranks": "?"}
    ax.set_title(f"{first['collective']} on {first['ranks']} ranks ({first['backend']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Write :func:`plot_figure` to ``path`` (PNG, Agg backend)."""
    import matplotlib.pyplot as plt

    fig = plot_figure(rows)
    fig.savefig(path)
    plt.close(fig)
