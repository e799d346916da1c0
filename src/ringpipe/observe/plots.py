"""The doctor's picture: a rank x rank heat map of link bandwidth, hosts outlined."""

from __future__ import annotations

from typing import Any

from ringpipe.observe.collect import JobEvents

__all__ = ["plot_links", "links_figure"]


def links_figure(job: JobEvents, links: list[dict[str, Any]]) -> Any:
    """The heat map as a matplotlib figure (Agg backend).

    The colour scale is logarithmic over at least two decades below the fastest link, so that
    a link ten or a hundred times slower stands out while a few per cent of noise between
    healthy links does not.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    p = job.size
    grid = np.full((p, p), np.nan)
    for x in links:
        grid[x["src"], x["dst"]] = grid[x["dst"], x["src"]] = max(x["gbps"], 1e-6)
    top = float(np.nanmax(grid)) if links else 1.0
    low = min([top / 100] + [max(x["gbps"], 1e-6) for x in links])
    fig, ax = plt.subplots(figsize=(max(4.5, 1.8 + 0.55 * p), max(3.8, 1.2 + 0.55 * p)))
    im = ax.imshow(grid, cmap="viridis", norm=LogNorm(vmin=low, vmax=top))
    fig.colorbar(im, ax=ax, label="GB/s (log scale)")
    hosts = job.hosts()
    for r in range(1, p):  # lines between hosts
        if hosts[r] != hosts[r - 1]:
            ax.axhline(r - 0.5, color="white", lw=2)
            ax.axvline(r - 0.5, color="white", lw=2)
    mid = (low * top) ** 0.5
    for x in links:
        for a, b in ((x["src"], x["dst"]), (x["dst"], x["src"])):
            ax.text(b, a, f"{x['gbps']:.2g}", ha="center", va="center", fontsize=7,
                    color="black" if x["gbps"] > mid else "white")
    ax.set(xticks=range(p), yticks=range(p), xlabel="rank", ylabel="rank",
           title=f"link bandwidth (GB/s)\n{p} ranks on {len(set(hosts))} host(s)")
    fig.tight_layout()
    return fig


def plot_links(job: JobEvents, links: list[dict[str, Any]], path: str) -> None:
    """Write :func:`links_figure` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = links_figure(job, links)
    fig.savefig(path, dpi=100)
    plt.close(fig)
