"""Seed 002's strong-scaling table for its Keras CNN: total training time on 1 and 2 processes, in one run.

Runs ``examples/tensorflow_keras_mnist_style.py`` (seed 002's Keras + Horovod program with the
import changed to ``ringpipe.tensorflow.keras``) under ``ringpipe launch -n N`` for N = 1, 2,
alternating, ``--repeats`` times, and reads the program's own "Hvd Procs N Total time" line (the
``fit`` alone, as in the seed). The data set is fixed (the 1,797 digits), so each process trains
on 1/N of it per epoch: strong scaling. The table gives every run and the median per N.

    python benchmarks/tf_scaling.py --repeats 3 --epochs 4
    python benchmarks/tf_scaling.py --quick       # seconds: one run of 2 processes, one timed epoch
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import procs, report, stats  # noqa: E402

__all__ = ["main"]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tensorflow_keras_mnist_style.py"


def total_time(n: int, epochs: int, env: dict) -> float:
    out = procs.run(procs.ringpipe_cli("launch", "-n", str(n), str(EXAMPLE), "--epochs", str(epochs),
                                       "--warmup_epochs", "1"), 1800, env)
    match = re.search(r"Hvd Procs (\d+) Total time: ([0-9.]+) second", out)
    if not match:
        raise SystemExit(f"no total time in the output:\n{out[-2000:]}")
    return float(match.group(2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="seconds: one run of 2 processes, 1 epoch (no speed-up)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.epochs = 1, 1
    report.header("tf_scaling", argv)
    env = dict(TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="2")
    sizes = (2,) if args.quick else (1, 2)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(args.repeats):
        for n in (sizes if i % 2 == 0 else sizes[::-1]):
            times[n].append(total_time(n, args.epochs, env))
            print(f"Hvd Procs {n} Total time: {times[n][-1]:.2f} second", flush=True)
    print(f"\nseed 002's Keras CNN, {args.epochs} epochs, batch 32 per process; fit time in s\n")
    one = stats.median(times[1]) if 1 in times else None
    print(report.table(("processes", "runs", "median", "speed-up"),
                       [(n, ", ".join(f"{t:.2f}" for t in times[n]), f"{stats.median(times[n]):.2f}",
                         f"{one / stats.median(times[n]):.2f}x" if one else "-") for n in sizes],
                       (True, False, True, True)))
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
