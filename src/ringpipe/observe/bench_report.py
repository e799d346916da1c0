"""What ``ringpipe bench`` prints and draws: rows, per-size comparisons against native, busbw plots.

Every comparison against the backend's own collective uses one statistic, the one ``auto``'s probe
decides by (:func:`ringpipe.collectives.autotune.paired`): in each interleaved round, the variant's
time over native's (blocks that ran next to each other, so a drift of the machine weighs on both);
the median of those ratios (``0.46x native's time``: below 1 is faster) and the rounds the variant
was faster in (``faster in 7/9 rounds``). A verdict is ``faster`` (or ``slower``) when the variant
was faster (slower) than native in at least :data:`~ringpipe.collectives.autotune.MAJORITY` of the
rounds, the share the probe asks of a candidate, by at least its margin
(:data:`~ringpipe.collectives.autotune.MARGIN`); otherwise ``inconclusive``; ``auto`` running native
is ``native itself`` (the ratio of a collective to itself is the noise of the machine). Where ``auto``'s table
was probed at the size, the probe's own figures stand beside the sweep's: the same statistic over
other rounds (the probe's, timed before the sweep), so the two differ by what the machine's noise
does between them, and the table says which is which.
"""

from __future__ import annotations

from typing import Any

from ringpipe.collectives.autotune import MAJORITY, MARGIN, paired

__all__ = ["compare", "format_comparison", "format_row", "format_summary", "format_table", "plot", "plot_figure",
           "verdict"]

#: auto's verdict when it ran native: the same collective in both rows, whose ratio is the noise.
SAME = "native itself"

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


def verdict(ratio: float, wins: int, rounds: int, margin: float = MARGIN, majority: float = MAJORITY) -> str:
    """The probe's rule (:func:`ringpipe.collectives.autotune.decide`), both ways: ``faster`` when the
    median ratio is at most ``1 - margin`` and the variant was faster in at least ``majority`` of the
    rounds; ``slower`` when it is at least ``1 / (1 - margin)`` and it was slower in that many;
    otherwise ``inconclusive``."""
    if rounds and ratio <= 1.0 - margin and wins >= majority * rounds - 1e-9:
        return "faster"
    if rounds and ratio >= 1.0 / (1.0 - margin) and rounds - wins >= majority * rounds - 1e-9:
        return "slower"
    return "inconclusive"


def _against(variant: dict[str, Any], native: dict[str, Any]) -> tuple[float, int, int]:
    """(median of variant / native time per round, rounds the variant was faster, rounds)."""
    mine, theirs = variant.get("times_us"), native.get("times_us")
    if not mine or not theirs or len(mine) != len(theirs):  # no rounds to pair: the medians, no verdict
        return variant["time_us"] / max(native["time_us"], 1e-12), 0, 0
    return paired({"native": list(theirs), "x": list(mine)}, "x")


def _figures(prefix: str, variant: dict[str, Any], native: dict[str, Any]) -> dict[str, Any]:
    ratio, wins, rounds = _against(variant, native)
    return {f"{prefix}_ratio": round(ratio, 3), f"{prefix}_wins": wins, f"{prefix}_rounds": rounds,
            f"{prefix}_verdict": verdict(ratio, wins, rounds)}


def compare(size_rows: list[dict[str, Any]], probed: tuple[str, dict[str, list[float]]] | None = None
            ) -> dict[str, Any] | None:
    """The comparisons against native for one size's rows (None without a native row and another one).

    ``best``: the one of ringpipe's own algorithms with the smallest median ratio; ``*_ratio``:
    the median over the rounds of the variant's time over native's in the same round (below 1:
    faster); ``*_wins`` of ``*_rounds``: the rounds it was faster in; ``*_verdict``: faster, slower
    or inconclusive (:func:`verdict`). ``probed``: ``auto``'s probe at this size, (its choice, every
    candidate's time per round), reported as ``probe_*`` for the algorithm auto runs (for native:
    the best other), from the probe's own rounds.
    """
    by = {r["algorithm"]: r for r in size_rows}
    native = by.get("native")
    if native is None or len(by) < 2:
        return None
    out: dict[str, Any] = {"summary": True, "bytes": native["bytes"], "backend": native["backend"],
                           "ranks": native["ranks"], "native_us": native["time_us"]}
    own = [r for r in size_rows if r["algorithm"] not in ("native", "auto")]
    if own:
        best = min(own, key=lambda r: (_against(r, native)[0], r["algorithm"]))
        out.update(best=best["algorithm"], best_us=best["time_us"], **_figures("best", best, native))
    auto = by.get("auto")
    if auto is not None:
        out.update(auto_chose=auto.get("chosen", "?"), auto_us=auto["time_us"], **_figures("auto", auto, native))
        if out["auto_chose"] == "native":  # the same collective twice: its ratio is the machine's noise
            out["auto_verdict"] = SAME
    if probed is not None:
        choice, times = probed
        others = [a for a in times if a != "native" and times[a]]
        if times.get("native") and others:
            shown = choice if choice != "native" else min(others, key=lambda a: (paired(times, a)[0], a))
            ratio, wins, rounds = paired(times, shown)
            out.update(probe_chose=choice, probe_algorithm=shown, probe_ratio=ratio, probe_wins=wins,
                       probe_rounds=rounds, probe_verdict=verdict(ratio, wins, rounds))
    return out


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else \
        f"{n >> 10} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} B"


def _figure_text(c: dict[str, Any], prefix: str, which: str = "rounds") -> str:
    ratio, wins, rounds = c[f"{prefix}_ratio"], c[f"{prefix}_wins"], c[f"{prefix}_rounds"]
    faster = f", faster in {wins}/{rounds} {which}" if rounds else " (medians: no rounds to pair)"
    return f"{ratio:.2f}x native's time{faster} [{c[f'{prefix}_verdict']}]"


def format_comparison(c: dict[str, Any]) -> str:
    """One line: best own algorithm and auto against native at one size, and the probe's figures there."""
    parts = [f"# {_size(c['bytes'])}:"]
    if "best" in c:
        parts.append(f"best own ({c['best']}) {_figure_text(c, 'best')};")
    if "auto_chose" in c:
        parts.append(f"auto ({c['auto_chose']}) {_figure_text(c, 'auto')};")
    if "probe_chose" in c:
        which = c["probe_algorithm"] if c["probe_chose"] != "native" else f"native; best other {c['probe_algorithm']}"
        parts.append(f"auto's probe ({which}) {_figure_text(c, 'probe', 'of its own rounds, before the sweep')}")
    return " ".join(parts).rstrip(";")


def format_summary(comparisons: list[dict[str, Any]]) -> str:
    """The per-size comparisons as one table, every ratio the same statistic (see the module)."""
    head = (f"{'size':>8} {'native us':>10} {'best own':>18} {'x native':>8} {'faster':>7} {'verdict':>12} "
            f"{'auto chose':>18} {'x native':>8} {'faster':>7} {'verdict':>12} {'probe x native':>14} "
            f"{'faster':>7} {'verdict':>12}")
    lines = [head]
    for c in comparisons:
        lines.append(f"{_size(c['bytes']):>8} {c['native_us']:>10.1f} {c.get('best', '-'):>18} "
                     f"{_cells(c, 'best')} {c.get('auto_chose', '-'):>18} {_cells(c, 'auto')} "
                     f"{_cells(c, 'probe', 14)}")
    return "\n".join(lines)


def _cells(c: dict[str, Any], prefix: str, width: int = 8) -> str:
    if f"{prefix}_ratio" not in c:
        return f"{'-':>{width}} {'-':>7} {'-':>12}"
    rounds = c[f"{prefix}_rounds"]
    faster = f"{c[f'{prefix}_wins']}/{rounds}" if rounds else "-"
    return f"{c[f'{prefix}_ratio']:>{width}.2f} {faster:>7} {c[f'{prefix}_verdict']:>12}"


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
