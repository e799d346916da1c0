"""What the cross-rank call check costs: checked against unchecked collectives in the same run.

Every rank makes the same calls; per iteration the slowest rank's time counts. For each size,
the communicator's native allreduce is timed with its check (one header message per doubling
step before the payload) and inside ``comm.unchecked()``, alternating one call of each, and
the Horovod-style ``hvd.allreduce`` (whose announcement carries the check) beside them, the
order rotated every iteration. Medians
with the 10th-90th percentile spread are printed; the ratio is checked / unchecked.

    python benchmarks/check_cost.py                       # 2 ranks over gloo, 4 KiB and 4 MiB
    python benchmarks/check_cost.py --ranks 3 --iters 200
    PYTHONPATH=OLD/src python benchmarks/check_cost.py --variants hvd.allreduce   # an older tree
"""

from __future__ import annotations

import argparse
import statistics
import time

SIZES = [4 << 10, 4 << 20]
VARIANTS = ("unchecked", "checked", "hvd.allreduce")


def _work(comm, iters: int, warmup: int, variants: tuple[str, ...]) -> dict:  # noqa: ANN001
    import torch

    import ringpipe as hvd

    torch.set_num_threads(1)
    hvd.init(comm)
    out: dict = {}
    for size in SIZES:
        x = torch.ones(size // 4)
        for i in range(warmup + iters):
            k = i % len(variants)
            for v in variants[k:] + variants[:k]:  # rotated: no variant always runs first
                comm.barrier()
                t = time.perf_counter()
                if v == "unchecked":
                    with comm.unchecked():
                        comm.allreduce(x, "sum")
                elif v == "checked":
                    comm.allreduce(x, "sum")
                else:
                    hvd.allreduce(x, op=hvd.Sum)
                if i >= warmup:
                    out.setdefault((size, v), []).append(time.perf_counter() - t)
    hvd.shutdown()
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    from ringpipe.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    args = ap.parse_args()
    variants = tuple(v for v in args.variants.split(",") if v)
    if not set(variants) <= set(VARIANTS):
        ap.error(f"--variants takes names from {', '.join(VARIANTS)}")
    per_rank = spawn(_work, args.ranks, args=(args.iters, args.warmup, variants))
    print(f"ranks={args.ranks} backend=gloo iters={args.iters} warmup={args.warmup} threads=1 "
          "(the same tensor, op sum, every variant in turn within each iteration)")
    print(f"{'bytes':>9} {'variant':>14} {'median us':>10} {'p10-p90 us':>16} {'x unchecked':>12}")
    for size in SIZES:
        base = None
        for v in variants:
            slowest = [max(r[(size, v)][i] for r in per_rank) for i in range(args.iters)]
            med = statistics.median(slowest) * 1e6
            base = med if v == "unchecked" else base
            spread = f"{_pct(slowest, 0.1) * 1e6:.0f}-{_pct(slowest, 0.9) * 1e6:.0f}"
            ratio = f"{med / base:>12.2f}" if base else f"{'-':>12}"
            print(f"{size:>9} {v:>14} {med:>10.1f} {spread:>16} {ratio}")


if __name__ == "__main__":
    main()
