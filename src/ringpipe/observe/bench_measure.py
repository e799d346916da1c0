"""Timing collectives for ``ringpipe bench``: the size sweep, the buffers, and interleaved blocks.

Why interleaved: on a shared or drifting host the speed of the same collective changes from one
second to the next, so variants timed one after another are compared at different times (the
backend's own allreduce came out at 0.56-1.24x of itself that way). :func:`run_bench` therefore
times every variant of one size (the native collective, each of ringpipe's algorithms, ``auto``)
in blocks of ``iters`` calls, the variants taking turns within each of ``repeats`` rounds in the
order of :func:`ringpipe.collectives.autotune.block_order` (rotated and reversed from round to
round, so that no variant always runs first, last or next to the same neighbour). A block's time
per call is that of the slowest rank (a collective is done when its last rank is); each row
reports the median over the rounds and its spread (min, quartiles, max).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ringpipe import collectives
from ringpipe.collectives.autotune import block_order
from ringpipe.collectives.common import home_device
from ringpipe.comm.base import Communicator

__all__ = ["COLLECTIVES", "bus_factor", "check_algorithms", "parse_size", "run_bench", "spread"]

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "p2p")
_API = {"allreduce": "allreduce", "allgather": "allgather", "reducescatter": "reduce_scatter",
        "broadcast": "broadcast"}
#: With no ``iters`` given, a block lasts about this long (between MIN_ITERS and MAX_ITERS calls).
BLOCK_SECONDS = 0.2
MIN_ITERS, MAX_ITERS = 3, 100


def bus_factor(collective: str, p: int) -> float:
    """nccl-tests' busbw / algbw factor for ``collective`` on ``p`` ranks."""
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("allgather", "reducescatter"):
        return (p - 1) / p
    return 1.0


def parse_size(text: str) -> int:
    """``4K``, ``1M``, ``64MiB``, ``1G`` or plain bytes -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)(i?[Bb])?\s*", str(text))
    if not m:
        raise ValueError(f"size {text!r} is not understood; write bytes like 4096, 4K, 1M or 64MiB")
    return int(m.group(1)) * 1024 ** " KMG".index((m.group(2) or " ").upper())


def _sizes(begin: int, end: int, factor: float, item: int = 1) -> list[int]:
    """Sizes from ``begin`` to ``end`` bytes by ``factor``, each at least ``item`` bytes past the last.

    A ``begin`` of 0 comes first (timed as the smallest buffer), then the sweep goes on from one element.
    """
    if begin < 0 or end < 0:
        raise ValueError(f"sizes must be >= 0, got -b {begin} -e {end}")
    if begin > end:
        raise ValueError(f"-b {begin} is larger than -e {end}; give -b <= -e")
    if begin == end:
        return [begin]
    if factor <= 1:
        raise ValueError(f"-f must be > 1 to sweep from -b {begin} to -e {end}, got {factor:g}")
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = item if s == 0 else max(int(s * factor), s + item)
    return out


def _count(collective: str, nbytes: int, item: int, p: int) -> int:
    """Elements of the buffer measured for ``nbytes``: at least one (one per rank where it is split)."""
    if collective in ("allgather", "reducescatter"):
        count = max(p, nbytes // item)
        return count - count % p
    return max(1, nbytes // item)


def _runner(comm: Communicator, collective: str, algo: str, nbytes: int, dtype: torch.dtype,
            check: bool) -> tuple[Callable[[], Any], Callable[[], int], int]:
    """(one call, a checked call returning the number of wrong elements, element count).

    Timed calls run on zeros, so that repeated reductions of the same buffer stay finite.
    """
    p, r = comm.size, comm.rank
    item = torch.empty((), dtype=dtype).element_size()
    device = home_device(comm)
    count = _count(collective, nbytes, item, p)
    if collective == "p2p":
        buf = torch.zeros(count, dtype=dtype, device=device)

        def pingpong() -> None:
            if r == 0:
                comm.send(buf, 1)
                comm.recv(buf, 1)
            elif r == 1:
                comm.recv(buf, 0)
                comm.send(buf, 0)

        def p2p_check() -> int:
            buf.fill_(r + 1)
            pingpong()
            wrong = int((buf != 1).sum()) if r == 0 else 0
            buf.zero_()
            return wrong

        return pingpong, p2p_check, count
    name = _API[collective]
    fn = getattr(collectives, name)
    local = count // p if collective == "allgather" else count
    x = torch.zeros(local, dtype=dtype, device=device)
    kw: dict[str, Any] = {"algorithm": algo}
    if algo != "native":
        kw["check"] = check

    def call() -> Any:
        return fn(comm, x, **kw)

    def checked() -> int:
        x.fill_(r + 1)
        out = fn(comm, x, **kw)
        total = p * (p + 1) // 2
        if collective == "allreduce":
            wrong = int((x != total).sum())
        elif collective == "reducescatter":
            wrong = int((out != total).sum())
        elif collective == "broadcast":
            wrong = int((x != 1).sum())
        else:
            wrong = sum(int((blk != j + 1).sum()) for j, blk in enumerate(out))
        x.zero_()
        return wrong

    return call, checked, count


def check_algorithms(collective: str, algorithms: list[str] | None) -> list[str]:
    """The algorithms to time for ``collective`` (all of them when None); ValueError for unknown names."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    if collective == "p2p":
        return ["p2p"]
    valid = collectives.SUPPORTED[_API[collective]]
    algos = algorithms or [a for a in valid if a != "auto"] + ["auto"]
    for a in algos:
        if a not in valid:
            raise ValueError(f"{collective} has no algorithm {a!r}; valid: {', '.join(valid)}")
    return list(algos)


def _sync(comm: Communicator) -> None:
    """Wait for queued GPU work (NCCL returns before the transfer is done)."""
    device = home_device(comm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(times: list[float]) -> dict[str, float]:
    """Median, min, quartiles and max of ``times`` (the quartiles are the median for fewer than 2)."""
    q1 = q3 = statistics.median(times)
    if len(times) >= 2:
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return {"median": statistics.median(times), "min": min(times), "q1": q1, "q3": q3, "max": max(times)}


def _block(comm: Communicator, call: Callable[[], Any], iters: int) -> float:
    """Seconds per call of ``iters`` calls started together on every rank."""
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(comm)
    return (time.perf_counter() - t0) / iters


def _iters_for(comm: Communicator, calls: list[Callable[[], Any]]) -> int:
    """Calls per block so that one lasts about :data:`BLOCK_SECONDS` (the slowest variant, slowest rank)."""
    slowest = max(_block(comm, call, 1) for call in calls)
    slowest = max(comm.allgather_object(slowest))
    return max(MIN_ITERS, min(MAX_ITERS, int(BLOCK_SECONDS / max(slowest, 1e-9))))


def run_bench(
    comm: Communicator,
    collective: str,
    sizes: list[int],
    algorithms: list[str] | None = None,
    iters: int | None = 20,
    warmup: int = 5,
    dtype: torch.dtype = torch.float32,
    check: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    repeats: int = 5,
    on_size: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Time ``collective`` for every size and algorithm; every rank returns the same rows.

    For each size every algorithm is warmed up, then timed in ``repeats`` rounds of one block of
    ``iters`` calls each (None: enough calls for about :data:`BLOCK_SECONDS` a block), the
    algorithms interleaved. ``time_us`` is the median over the rounds of the slowest rank's time
    per call; ``time_min_us`` / ``time_q1_us`` / ``time_q3_us`` / ``time_max_us`` its spread over
    the rounds, ``times_us`` the time of every round in order; bandwidths follow from the median. Sizes whose buffer rounds to the one of the
    size before (below one element) are measured once. ``on_row`` is called with each row and
    ``on_size`` with the rows of each size as soon as they are measured (on every rank).
    """
    algos = check_algorithms(collective, algorithms)
    if collective == "p2p" and comm.size < 2:
        raise ValueError("p2p needs at least 2 ranks")
    if (iters is not None and iters < 1) or warmup < 0 or repeats < 1:
        raise ValueError(f"needs iters >= 1, warmup >= 0 and repeats >= 1, got {iters}, {warmup} and {repeats}")
    rows: list[dict[str, Any]] = []
    item = torch.empty((), dtype=dtype).element_size()
    last: int | None = None
    for nbytes in sizes:
        measured = _count(collective, nbytes, item, comm.size)
        if measured == last:
            continue
        last = measured
        runners = {algo: _runner(comm, collective, algo, nbytes, dtype, check) for algo in algos}
        for call, _, _ in runners.values():
            for _ in range(warmup):
                call()
        _sync(comm)
        n = iters if iters is not None else _iters_for(comm, [c for c, _, _ in runners.values()])
        mine: dict[str, list[float]] = {algo: [] for algo in algos}
        for rnd in range(repeats):
            for algo in block_order(algos, rnd):
                mine[algo].append(_block(comm, runners[algo][0], n) / (2 if collective == "p2p" else 1))
        wrong = {algo: checked() for algo, (_, checked, _) in runners.items()}
        gathered = comm.allgather_object((mine, wrong))
        count = next(iter(runners.values()))[2]
        size_rows = [_row(comm, collective, algo, count, item, dtype, n, repeats,
                          [max(g[0][algo][k] for g in gathered) for k in range(repeats)],
                          sum(g[1][algo] for g in gathered)) for algo in algos]
        del runners
        rows += size_rows
        for row in size_rows:
            if on_row is not None:
                on_row(row)
        if on_size is not None:
            on_size(size_rows)
    return rows


def _row(comm: Communicator, collective: str, algo: str, count: int, item: int, dtype: torch.dtype,
         iters: int, repeats: int, times: list[float], wrong: int) -> dict[str, Any]:
    """One algorithm at one size: its times over the rounds (slowest rank each) summarised."""
    size_b = count * item
    s = spread(times)
    algbw = size_b / s["median"] / 1e9 if s["median"] > 0 else 0.0
    chosen = collectives.resolve(_API[collective], "auto", size_b, comm) \
        if algo == "auto" and collective in _API else algo
    return {
        "collective": collective, "algorithm": algo, "chosen": chosen, "backend": comm.backend,
        "ranks": comm.size, "bytes": size_b, "count": count, "dtype": str(dtype).removeprefix("torch."),
        "iters": iters, "repeats": repeats,
        "time_us": round(s["median"] * 1e6, 2), "time_min_us": round(s["min"] * 1e6, 2),
        "time_q1_us": round(s["q1"] * 1e6, 2), "time_q3_us": round(s["q3"] * 1e6, 2),
        "time_max_us": round(s["max"] * 1e6, 2), "times_us": [round(t * 1e6, 2) for t in times],
        "algbw_gbps": round(algbw, 4),
        "busbw_gbps": round(algbw * bus_factor(collective, comm.size), 4), "wrong": wrong,
    }
