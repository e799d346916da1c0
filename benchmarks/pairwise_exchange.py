"""Two ranks' sum: gloo's own allreduce against one exchange of point-to-point messages.

    python benchmarks/pairwise_exchange.py                       # 2 ranks, gloo, 4 KiB - 16 MiB
    chrt -f 10 python benchmarks/pairwise_exchange.py            # on a host shared with other jobs

Why the data-parallel path keeps gloo's allreduce on two ranks although a swap and an add looks
cheaper: for every size, in interleaved rounds (the two variants take turns, the order flipping
every round), the time of one blocking sum of a float32 vector, posted and waited for:
``native`` is the communicator's ``iallreduce`` (gloo's allreduce), ``pairwise`` posts the vector
to the other rank and a receive of the other's (``isend``/``irecv``), waits for both and adds.
Both run on the same processes, tensors and threads (one torch thread), and each result is
checked against the sum written here. ``--compute N`` puts N 128x128 matrix products before each
call, as a training step has computation between its reductions. Reported per size: median and p10-p90 over every call of the slowest rank, and
the ratio of medians; "apart" when the p10-p90 ranges do not overlap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB


def _calls(nbytes: int) -> int:
    return 100 if nbytes <= 256 * 1024 else 20 if nbytes <= 4 << 20 else 6


def _pairwise(comm: Any, x: torch.Tensor) -> None:
    theirs = torch.empty_like(x)
    send = comm._isend(x, 1 - comm.rank, 7_200_001)
    recv = comm._irecv(theirs, 1 - comm.rank, 7_200_001)
    recv.wait()
    send.wait()
    x.add_(theirs)


def run_ranks(comm: Any, sizes: tuple[int, ...], rounds: int, compute: int = 0) -> dict[int, dict[str, list[float]]]:
    torch.set_num_threads(1)
    a = torch.rand(128, 128)
    out: dict[int, dict[str, list[float]]] = {}
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.empty(n)
        variants = {"native": lambda x=x: comm.iallreduce(x).wait(), "pairwise": lambda x=x: _pairwise(comm, x)}
        expected = torch.full((n,), 3.0)  # 1 + 2 from ranks 0 and 1
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                f = variants[name]
                x.fill_(comm.rank + 1.0)
                f()
                if not torch.equal(x, expected):
                    raise SystemExit(f"{name} at {nbytes} B: wrong sum on rank {comm.rank}")
                comm.barrier()
                for _ in range(_calls(nbytes)):
                    x.fill_(comm.rank + 1.0)
                    t0 = time.perf_counter()
                    for _ in range(compute):
                        a @ a
                    f()
                    times[name].append(time.perf_counter() - t0)
        every = comm.allgather_object(times)
        out[nbytes] = {k: [max(e[k][i] for e in every) for i in range(len(times[k]))] for k in times}
    return out


def _q(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(results: dict[int, dict[str, list[float]]]) -> str:
    lines = ["| size | native us, median [p10-p90] | pairwise us, median [p10-p90] | native / pairwise | |",
             "| ---: | --- | --- | ---: | --- |"]
    for nbytes, v in results.items():
        cells = []
        for k in ("native", "pairwise"):
            t = v[k]
            cells.append(f"{statistics.median(t) * 1e6:.0f} [{_q(t, 0.1) * 1e6:.0f}-{_q(t, 0.9) * 1e6:.0f}]")
        ratio = statistics.median(v["native"]) / statistics.median(v["pairwise"])
        apart = _q(v["pairwise"], 0.9) < _q(v["native"], 0.1) or _q(v["native"], 0.9) < _q(v["pairwise"], 0.1)
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        lines.append(f"| {size} | {cells[0]} | {cells[1]} | {ratio:.2f} | {'apart' if apart else 'overlap'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma separated")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--compute", type=int, default=0, help="128x128 matrix products before each call")
    args = p.parse_args(argv)
    from ringpipe.launch import spawn

    sizes = tuple(int(s) for s in args.sizes.split(","))
    results = spawn(run_ranks, 2, args=(sizes, args.rounds, args.compute))[0]
    print(f"2 ranks, gloo, float32, {args.rounds} interleaved rounds, {args.compute} matrix products before "
          f"each call; load {os.getloadavg()[0]:.1f}")
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
