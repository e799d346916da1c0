"""Measured choices for ``auto``: a probe that times every allreduce algorithm, cached per job and topology.

Why: which allreduce is fastest depends on the backend, the number of ranks, the host and the
message size (on a 2-core loopback host gloo's own allreduce wins at some sizes, ringpipe's
recursive doubling or ring at others; Open MPI's shared-memory collective wins below tens of MiB).
:func:`probe` times, on every rank together, the backend's own allreduce and each of ringpipe's
algorithms at a sweep of sizes, in the form ``auto`` would run them (checked), and keeps for each
size the fastest; the backend's collective is kept unless another is faster by more than
:data:`MARGIN` in every round, so that ``auto`` is never slower than native by more than the noise. The
choice of every size is decided from timings gathered from every rank (the slowest rank counts),
so every rank holds the same table and ``auto`` resolves the same way everywhere.

The table lives in this process, keyed by backend, number of ranks and the hosts of the ranks
(:func:`key`); :meth:`Table.save` writes it as JSON and :func:`load` reads one back on every rank
(rank 0's file, broadcast), for jobs that should not spend the probe's seconds again.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

import torch

from ringpipe.comm.base import Communicator

__all__ = ["MARGIN", "PROBE_SIZES", "Table", "block_order", "candidates", "decide", "forget", "key", "load",
           "lookup", "probe"]

#: Another algorithm replaces the native collective only if it is at least this much faster.
MARGIN = 0.10
#: The sizes the probe times by default: 4 KiB to 64 MiB by factors of 4.
PROBE_SIZES = tuple(4096 * 4**i for i in range(9))

_TABLES: dict[tuple[Any, ...], Table] = {}


def key(comm: Communicator) -> tuple[Any, ...]:
    """What a table is valid for: backend, number of ranks and the host of every rank."""
    hosts = getattr(getattr(comm, "topology", None), "hostnames", None)
    members = tuple(hosts[g] for g in comm.global_ranks) if hosts else None
    return (getattr(comm, "backend", "?"), comm.size, members)


class Table:
    """Per measured size: the chosen algorithm and every candidate's time in seconds."""

    def __init__(self, rows: list[tuple[int, str, dict[str, float]]], for_key: tuple[Any, ...]) -> None:
        self.rows = sorted(rows)
        self.key = for_key

    def choose(self, nbytes: int) -> str:
        """The choice of the measured size nearest to ``nbytes`` (on a log scale)."""
        if not self.rows:
            return "native"
        target = math.log2(max(nbytes, 1))
        return min(self.rows, key=lambda r: abs(math.log2(r[0]) - target))[1]

    def to_json(self) -> dict[str, Any]:
        return {"key": list(self.key[:2]) + [list(self.key[2]) if self.key[2] else None],
                "rows": [{"bytes": b, "choice": c, "seconds": t} for b, c, t in self.rows]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Table:
        k = data["key"]
        return cls([(r["bytes"], r["choice"], r["seconds"]) for r in data["rows"]],
                   (k[0], k[1], tuple(k[2]) if k[2] else None))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def __repr__(self) -> str:
        return "Table(" + ", ".join(f"{b}: {c}" for b, c, _ in self.rows) + ")"


def lookup(comm: Communicator) -> Table | None:
    """The table measured (or loaded) for ``comm``'s backend, size and hosts in this process, if any."""
    return _TABLES.get(key(comm))


def forget(comm: Communicator | None = None) -> None:
    """Drop the table of ``comm`` (every table with None): ``auto`` falls back to its recorded rules."""
    if comm is None:
        _TABLES.clear()
    else:
        _TABLES.pop(key(comm), None)


def candidates(comm: Communicator) -> list[str]:
    """The allreduce algorithms worth timing on ``comm`` (hierarchical only across several hosts)."""
    out = ["native", "ring", "recursive_doubling", "rabenseifner"]
    k = key(comm)
    if k[2] and 1 < len(set(k[2])) < comm.size:
        out.append("hierarchical")
    return out


def _iters(nbytes: int) -> int:
    return 20 if nbytes <= 256 * 1024 else 8 if nbytes <= 4 << 20 else 3


def block_order(names: list[str], rnd: int) -> list[str]:
    """The order in which ``names`` take turns in round ``rnd`` of an interleaved measurement.

    Even rounds run forward, odd rounds backward (a drift that grows through a round weighs on
    every name alike over a pair of rounds), and each pair of rounds starts one name further on,
    so that over rounds every name runs first and last and beside different neighbours.
    """
    if not names:
        return []
    shift = (rnd // 2) % len(names)
    order = names[shift:] + names[:shift]
    return order if rnd % 2 == 0 else order[::-1]


def decide(best: dict[str, float], worst: dict[str, float], margin: float = MARGIN) -> str:
    """The choice for one size from every candidate's fastest and slowest round (seconds per call).

    The backend's collective (``native``) is kept unless another candidate's *slowest* round beats
    native's *fastest* by ``margin``: where native measured fastest, or where the rounds of a
    faster-looking candidate overlap native's, ``auto`` runs native. Without a native candidate,
    the candidate with the fastest slowest round.
    """
    choice = min(worst, key=lambda a: (worst[a], a))
    if "native" in best and choice != "native" and worst[choice] > (1.0 - margin) * best["native"]:
        return "native"
    return choice


def probe(comm: Communicator, sizes: tuple[int, ...] | list[int] = PROBE_SIZES, rounds: int = 2,
          dtype: torch.dtype = torch.float32) -> Table:
    """Time every candidate at every size on every rank (collective); keep and return the table.

    Each size is timed in ``rounds`` rounds, the candidates taking turns in the order of
    :func:`block_order`; a candidate's time in a round is its median per call on the slowest rank.
    :func:`decide` makes the choice; the table keeps every candidate's fastest round.
    """
    from ringpipe import collectives  # the package that uses this module; imported when probing

    if comm.size < 2:
        table = Table([], key(comm))
        _TABLES[table.key] = table
        return table
    algos = candidates(comm)
    item = torch.empty((), dtype=dtype).element_size()
    rows = []
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // item), dtype=dtype)  # zeros: repeated sums stay finite
        best: dict[str, float] = {}
        worst: dict[str, float] = {}
        for r in range(rounds):
            mine: dict[str, float] = {}
            for algo in block_order(algos, r):
                collectives.allreduce(comm, x, algorithm=algo)  # warm-up
                times = []
                for _ in range(_iters(nbytes)):
                    t0 = time.perf_counter()
                    collectives.allreduce(comm, x, algorithm=algo)
                    times.append(time.perf_counter() - t0)
                mine[algo] = statistics.median(times)
            every = comm.allgather_object(mine)
            for algo in algos:
                slowest = max(e[algo] for e in every)
                best[algo] = min(best.get(algo, math.inf), slowest)
                worst[algo] = max(worst.get(algo, 0.0), slowest)
        rows.append((x.numel() * item, decide(best, worst), best))
    table = Table(rows, key(comm))
    _TABLES[table.key] = table
    return table


def load(comm: Communicator, path: str) -> Table:
    """Read a table written by :meth:`Table.save` on rank 0 and keep it on every rank (collective).

    Raises ``ValueError`` on every rank if it was measured for another backend, size or hosts.
    """
    data = None
    if comm.rank == 0:
        with open(path) as f:
            data = json.load(f)
    data = comm.broadcast_object(data, 0)
    table = Table.from_json(data)
    if table.key != key(comm):
        raise ValueError(
            f"the auto table {path} was measured for {table.key} but this job is {key(comm)}; "
            "run the probe again (ringpipe bench --auto-table PATH) on this topology"
        )
    _TABLES[table.key] = table
    return table
