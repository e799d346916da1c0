"""How many chunks a ring message is cut into: ring allreduce at each setting against native gloo, same run.

Every setting of ``ringpipe.collectives.common.MAX_CHUNKS`` (chunks of at least ``CHUNK_BYTES``)
is timed in turn with the native gloo allreduce, interleaved (the order rotated every iteration,
after one warm-up iteration), for 1-64 MiB; per iteration the slowest rank's time counts, and
the median over iterations is printed with native/ring.

    python benchmarks/chunks.py                 # 2 and 4 ranks
    python benchmarks/chunks.py --ranks 2 --iters 12
"""

from __future__ import annotations

import argparse
import statistics
import time

VARIANTS = [64, 8, 4]
SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _work(comm, iters: int) -> dict:  # noqa: ANN001 - a communicator
    import torch

    import ringpipe.collectives.common as common
    from ringpipe import collectives

    torch.set_num_threads(1)
    out: dict = {}
    for size in SIZES:
        x = torch.ones(size // 4)
        order = [*VARIANTS, "native"]
        for i in range(iters + 1):  # iteration 0 warms up (first messages, allocations) and is not kept
            for v in order[i % len(order):] + order[:i % len(order)]:  # rotated: no setting always first
                if v != "native":
                    common.MAX_CHUNKS = v  # the same on every rank: message tags depend on it
                comm.barrier()
                t = time.perf_counter()
                if v == "native":
                    comm.allreduce(x, "sum")
                else:
                    collectives.allreduce(comm, x, "sum", algorithm="ring")
                if i:
                    out.setdefault((size, v), []).append(time.perf_counter() - t)
    return out


def main() -> None:
    from ringpipe.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args()
    for n in (int(r) for r in args.ranks.split(",")):
        res = spawn(_work, n, args=(args.iters,), env={"OMP_NUM_THREADS": "1"})

        def t(size: int, v: object, res: list = res) -> float:
            return statistics.median(max(r[(size, v)][i] for r in res) for i in range(args.iters))

        print(f"## ring allreduce over gloo, {n} ranks: median ms (native / ring)", flush=True)
        for size in SIZES:
            nat = t(size, "native")
            print(f"{size >> 20:>3} MiB native {nat * 1e3:7.2f} | " + " | ".join(
                f"max_chunks={v} {t(size, v) * 1e3:7.2f} ({nat / t(size, v):.2f}x)" for v in VARIANTS), flush=True)


if __name__ == "__main__":
    main()
