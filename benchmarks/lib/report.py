"""The report every benchmark script prints: a header, Markdown tables, and headline rows.

A report opens with :func:`header`::

    # bench: dp_vs_ddp
    command: python benchmarks/dp_vs_ddp.py --models mlp
    machine: cpu=AMD EPYC 7B13, 2 cores; load=1.52 1.20 0.98; python=3.11.7; torch=2.13.0+cpu; ...

then the script's own tables (:func:`table`), and ends with :func:`headline`: one row per claim in
the columns of RESULTS.md's headline table (claim, peer, ratio as a median with its spread,
command, commit, machine), so that a figure can be copied there as printed. :func:`footer` says
the load average at the end. ``tests/test_benchmarks_quick.py`` checks every script's ``--quick``
output for the header and at least one table row.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from typing import Any

from lib import machine
from lib.stats import Spread

__all__ = ["HEADLINE_COLUMNS", "footer", "header", "headline", "table"]

HEADLINE_COLUMNS = ("claim", "peer", "ratio (median)", "spread", "command", "commit", "machine")

_state: dict[str, Any] = {}


def header(name: str, argv: Sequence[str] | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Print the report's header (name, exact command, machine) and return the machine's description."""
    args = sys.argv[1:] if argv is None else list(argv)
    info = machine.describe(extra)
    _state.update(name=name, command=" ".join(["python", f"benchmarks/{name}.py", *map(shlex.quote, args)]),
                  info=info)
    print(f"# bench: {name}")
    print(f"command: {_state['command']}")
    print("machine: " + "; ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    return info


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[bool] | None = None) -> str:
    """A Markdown table; ``numeric`` right-aligns the columns marked true."""
    numeric = numeric or [False] * len(columns)
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join(" ---: " if n else " --- " for n in numeric) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def headline(rows: Sequence[tuple[str, str, Spread]]) -> str:
    """Print and return the headline rows: ``(claim, peer, ratio spread)`` with this run's command,
    commit and machine (the ratio is ringpipe's time over the peer's: below 1 is faster)."""
    info = _state.get("info") or machine.describe()
    where = info["cpu"]
    cells = [(claim, peer, f"**{s.median:.3f}**", f"{s.low:.3f}-{s.high:.3f} ({s.kind})",
              f"`{_state.get('command', '')}`", info["commit"], where) for claim, peer, s in rows]
    text = "\n".join(["", "## headline", "", table(HEADLINE_COLUMNS, cells)])
    print(text, flush=True)
    return text


def footer() -> None:
    """Print the load average at the end of the run (a shared machine's load changes the figures)."""
    print(f"\nload average at the end: {machine.load()}", flush=True)
