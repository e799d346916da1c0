"""What the cross-rank call check costs: checked against unchecked collectives in the same run.

Every rank makes the same calls; per iteration the slowest rank's time counts. For each size,
the communicator's native allreduce is timed with its check (one header message per doubling
step before the payload) and inside ``comm.unchecked()``, alternating one call of each, and
the Horovod-style ``hvd.allreduce`` (whose announcement carries the check) beside them, the
order rotated every iteration. Medians
with the 10th-90th percentile spread are printed; the ratio is checked / unchecked.

    python benchmarks/check_cost.py                       # 2 ranks over gloo, 4 KiB and 4 MiB
    python benchmarks/check_cost.py --ranks 3 --iters 200
    python benchmarks/check_cost.py --quick              # seconds: 2 ranks, 3 iterations
    PYTHONPATH=OLD/src python benchmarks/check_cost.py --variants hvd.allreduce   # an older tree
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import report, sizes, stats  # noqa: E402

__all__ = ["main"]

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


def main(argv: list[str] | None = None) -> int:
    from ringpipe.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    ap.add_argument("--quick", action="store_true", help="seconds: 2 ranks, 3 iterations after 1 warm-up")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.iters, args.warmup = 2, 3, 1
    variants = tuple(v for v in args.variants.split(",") if v)
    if not set(variants) <= set(VARIANTS):
        ap.error(f"--variants takes names from {', '.join(VARIANTS)}")
    report.header("check_cost", argv)
    per_rank = spawn(_work, args.ranks, args=(args.iters, args.warmup, variants))
    print(f"\nranks={args.ranks} backend=gloo iters={args.iters} warmup={args.warmup} threads=1 "
          "(the same tensor, op sum, every variant in turn within each iteration; the slowest rank's time "
          "per iteration)\n")
    rows, headline = [], []
    for size in SIZES:
        slowest = {v: [max(r[(size, v)][i] for r in per_rank) for i in range(args.iters)] for v in variants}
        for v in variants:
            sp = stats.spread(slowest[v], "p10-p90")
            ratio = "-"
            if "unchecked" in slowest and v != "unchecked":
                ratio = f"{sp.median / stats.median(slowest['unchecked']):.2f}"
                headline.append((f"{'comm.allreduce' if v == 'checked' else v} with its cross-rank check, {sizes.label(size)}, {args.ranks} ranks",
                                 "the same allreduce unchecked", stats.ratios(slowest[v], slowest["unchecked"])))
            rows.append((sizes.label(size), v, f"{sp.median * 1e6:.1f}", f"{sp.low * 1e6:.0f}-{sp.high * 1e6:.0f}",
                         ratio))
    print(report.table(("size", "variant", "median us", "p10-p90 us", "x unchecked"), rows,
                       (True, False, True, True, True)))
    report.headline(headline)
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
