"""Measured choices for ``auto``: a probe that times every allreduce algorithm, cached per job and topology.

Why: which allreduce is fastest depends on the backend, the number of ranks, the host and the
message size (on a 2-core loopback host gloo's own allreduce wins at some sizes, ringpipe's
recursive doubling or ring at others; Open MPI's shared-memory collective wins below tens of MiB).
:func:`probe` times, on every rank together, the backend's own allreduce and each of ringpipe's
algorithms at a sweep of sizes, in the form ``auto`` would run them (checked), the candidates
taking turns round after round (:func:`block_order`), and :func:`decide` makes each size's choice
from *paired* ratios: a candidate's time over native's time in the same round. Pairing removes
most of a busy host's drift (both blocks ran seconds apart), so a candidate that is consistently
faster is recognised although the rounds' min-max spreads overlap; the backend's collective is
kept unless another is faster by more than :data:`MARGIN` in the median round and faster in at
least :data:`MAJORITY` of the rounds, so that ``auto`` is never slower than native by more than
the noise. Every round's time is the slowest rank's, gathered from every rank, so every rank
holds the same table and ``auto`` resolves the same way everywhere.

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

__all__ = ["MAJORITY", "MARGIN", "PROBE_SIZES", "Table", "block_order", "candidates", "contenders", "decide",
           "forget", "key", "load", "lookup", "paired", "probe", "schedule"]

#: Another algorithm replaces the native collective only if its median paired ratio to native
#: (its time over native's in the same round) is at most ``1 - MARGIN``...
MARGIN = 0.10
#: ... and it was faster than native in at least this fraction of the rounds.
MAJORITY = 2 / 3
#: The sizes the probe times by default: 4 KiB to 64 MiB by factors of 4.
PROBE_SIZES = tuple(4096 * 4**i for i in range(8))

_TABLES: dict[tuple[Any, ...], Table] = {}


def key(comm: Communicator) -> tuple[Any, ...]:
    """What a table is valid for: backend, number of ranks and the host of every rank."""
    hosts = getattr(getattr(comm, "topology", None), "hostnames", None)
    members = tuple(hosts[g] for g in comm.global_ranks) if hosts else None
    return (getattr(comm, "backend", "?"), comm.size, members)


def paired(times: dict[str, list[float]], algo: str) -> tuple[float, int, int]:
    """``algo`` against ``native`` round by round: (median of algo / native, rounds algo was faster, rounds).

    ``times`` holds each candidate's time per call in every round of one size (the slowest rank's),
    the rounds in the same order for every candidate. A candidate the probe stopped timing early
    (it could no longer win enough rounds) has fewer rounds than native: its rounds pair with
    native's first ones, and the rounds it missed count as not faster.
    """
    mine, native = times[algo], times["native"]
    if not mine or len(mine) > len(native):
        raise ValueError(f"{algo} has {len(mine)} rounds and native {len(native)}: the probe times every "
                         "candidate once per round, so a candidate needs at least one round and no more than native")
    ratios = [a / max(n, 1e-12) for a, n in zip(mine, native, strict=False)]
    return statistics.median(ratios), sum(r < 1.0 for r in ratios), len(native)


def _needed(rounds: int, majority: float) -> int:
    """Rounds a candidate must win out of ``rounds``: at least ``majority`` of them."""
    return math.ceil(majority * rounds - 1e-9)


def decide(times: dict[str, list[float]], margin: float = MARGIN, majority: float = MAJORITY) -> str:
    """The choice for one size from every candidate's time per call in each round (seconds).

    The rule, with ``r_k = t_candidate,k / t_native,k`` the paired ratio of round ``k`` of ``n``:
    a candidate *qualifies* when the median of its ``r_k`` is at most ``1 - margin`` **and** it
    was faster than native (``r_k < 1``) in at least ``majority * n`` rounds (6 of 9, 5 of 7,
    4 of 5; with one or two rounds, every round; rounds a candidate was not timed in, after the
    probe dropped it, count as not faster). Of the qualifying candidates the one with the
    smallest median ratio is chosen (ties by name); with none, ``native``. So a candidate whose
    rounds are noisy but consistently faster is taken, and one that is faster only in its median,
    or only in some rounds, or by less than the margin, is not: ``auto`` then runs native.
    Without a native candidate: the candidate with the smallest median time.
    """
    if not times:
        raise ValueError("decide needs the times of at least one candidate")
    if "native" not in times:
        return min(times, key=lambda a: (statistics.median(times[a]), a))
    best, best_ratio = "native", math.inf
    for algo in sorted(times):
        if algo == "native":
            continue
        ratio, wins, n = paired(times, algo)
        if ratio <= 1.0 - margin and wins >= _needed(n, majority) and ratio < best_ratio:
            best, best_ratio = algo, ratio
    return best


def contenders(times: dict[str, list[float]], names: list[str], planned: int, majority: float = MAJORITY) -> list[str]:
    """Of ``names``, native and every candidate that can still win ``majority`` of ``planned`` rounds.

    After the rounds timed so far (native's count), a candidate that has won ``w`` of them can
    still qualify in :func:`decide` only if ``w`` plus the rounds left reach the majority; the
    others need not be timed again, since no later round can change the choice.
    """
    left = planned - len(times["native"])
    return [a for a in names if a == "native" or paired(times, a)[1] + left >= _needed(planned, majority)]


class Table:
    """Per measured size: the chosen algorithm and every candidate's time per round, in seconds."""

    def __init__(self, rows: list[tuple[int, str, dict[str, list[float]]]], for_key: tuple[Any, ...]) -> None:
        self.rows = sorted(rows, key=lambda r: r[0])
        self.key = for_key

    def choose(self, nbytes: int) -> str:
        """The choice of the measured size nearest to ``nbytes`` (on a log scale).

        ``auto`` keeps these answers per communicator (:func:`ringpipe.collectives.auto.choose`).
        """
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
        # a single number per candidate (tables of earlier versions): one round
        rows = [(r["bytes"], r["choice"], {a: v if isinstance(v, list) else [v] for a, v in r["seconds"].items()})
                for r in data["rows"]]
        return cls(rows, (k[0], k[1], tuple(k[2]) if k[2] else None))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def __repr__(self) -> str:
        def one(b: int, c: str, t: dict[str, list[float]]) -> str:
            others = [a for a in t if a != "native" and t[a]]
            if "native" not in t or not t["native"] or not others:
                return f"{b}: {c}"
            shown = c if c != "native" else min(others, key=lambda a: (paired(t, a)[0], a))
            ratio, wins, n = paired(t, shown)
            what = f"{ratio:.2f}x native's time, faster in {wins}/{n} rounds"
            return f"{b}: {c} ({what})" if c != "native" else f"{b}: native (best other {shown}: {what})"
        return "Table(" + ", ".join(one(*r) for r in self.rows) + ")"


_generation = [0]  # bumped whenever a table is stored or dropped: choices kept from before are stale


def generation() -> int:
    """A number that changes whenever the tables change (``auto`` keeps its answers until then)."""
    return _generation[0]


def _store(table: Table) -> None:
    _TABLES[table.key] = table
    _generation[0] += 1


def lookup(comm: Communicator) -> Table | None:
    """The table measured (or loaded) for ``comm``'s backend, size and hosts in this process, if any."""
    return _TABLES.get(key(comm))


def forget(comm: Communicator | None = None) -> None:
    """Drop the table of ``comm`` (every table with None): ``auto`` falls back to its recorded rules."""
    if comm is None:
        _TABLES.clear()
    else:
        _TABLES.pop(key(comm), None)
    _generation[0] += 1


def candidates(comm: Communicator) -> list[str]:
    """The allreduce algorithms worth timing on ``comm`` (hierarchical only across several hosts)."""
    out = ["native", "ring", "recursive_doubling", "rabenseifner"]
    k = key(comm)
    if k[2] and 1 < len(set(k[2])) < comm.size:
        out.append("hierarchical")
    return out


def schedule(nbytes: int) -> tuple[int, int]:
    """(rounds, calls per block) the probe spends on a size by default.

    Small messages are cheap and noisy (a call takes about a millisecond, a busy host's time slice
    as much), so they get many rounds of many calls; large ones are long enough to time in a few
    calls: 9 x 20 up to 256 KiB, 7 x 8 up to 4 MiB, 7 x 3 above. (5 rounds above 4 MiB let the
    quiet 2-rank gloo probe take Rabenseifner at 16 MiB on 4 of 5 rounds at 0.88x native's time,
    and the sweep after it measured it 0.85x as fast as native; 7 rounds ask for 5 wins.)
    """
    if nbytes <= 256 * 1024:
        return 9, 20
    if nbytes <= 4 << 20:
        return 7, 8
    return 7, 3


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


def probe(comm: Communicator, sizes: tuple[int, ...] | list[int] = PROBE_SIZES, rounds: int | None = None,
          dtype: torch.dtype = torch.float32) -> Table:
    """Time every candidate at every size on every rank (collective); keep and return the table.

    Each size is timed in ``rounds`` rounds (None: :func:`schedule`'s number for the size), the
    candidates taking turns in the order of :func:`block_order` after one warm-up call each; a
    candidate's time in a round is its median per call over a block, on the slowest rank. A
    candidate that has lost so many rounds to native that it can no longer win the
    :data:`MAJORITY` :func:`decide` asks for is not timed in the rounds left (the choice is the
    same, the probe shorter). :func:`decide` makes the choice from those times; the table keeps
    them. On 2 ranks over gloo the default schedule over :data:`PROBE_SIZES` took 7-16 s on a
    2-core host with a load average of 3 to 5 (the 64 MiB size alone about 4 s).
    """
    from ringpipe import collectives  # the package that uses this module; imported when probing

    if rounds is not None and rounds < 1:
        raise ValueError(f"the probe needs at least one round per size, got rounds={rounds}")
    if comm.size < 2:
        table = Table([], key(comm))
        _store(table)
        return table
    algos = candidates(comm)
    item = torch.empty((), dtype=dtype).element_size()
    rows = []
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // item), dtype=dtype)  # zeros: repeated sums stay finite
        n_rounds, iters = schedule(x.numel() * item)
        n_rounds = rounds or n_rounds
        for algo in algos:
            collectives.allreduce(comm, x, algorithm=algo)  # warm-up
        times: dict[str, list[float]] = {algo: [] for algo in algos}
        alive = list(algos)
        for r in range(n_rounds):
            mine: dict[str, float] = {}
            for algo in block_order(alive, r):
                block = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    collectives.allreduce(comm, x, algorithm=algo)
                    block.append(time.perf_counter() - t0)
                mine[algo] = statistics.median(block)
            every = comm.allgather_object(mine)
            for algo in alive:
                times[algo].append(max(e[algo] for e in every))
            alive = contenders(times, alive, n_rounds)  # the same gathered times on every rank
        rows.append((x.numel() * item, decide(times), times))
    table = Table(rows, key(comm))
    _store(table)
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
    _store(table)
    return table
