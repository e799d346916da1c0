"""Seed 002's strong-scaling table for its Keras CNN: total training time on 1 and 2 processes, in one run.

Runs ``examples/tensorflow_keras_mnist_style.py`` (seed 002's Keras + Horovod program with the
import changed to ``ringpipe.tensorflow.keras``) under ``ringpipe launch -n N`` for N = 1, 2,
alternating, ``--repeats`` times, and reads the program's own "Hvd Procs N Total time" line (the
``fit`` alone, as in the seed). The data set is fixed (the 1,797 digits), so each process trains
on 1/N of it per epoch: strong scaling. The table gives every run and the median per N.

    python benchmarks/tf_scaling.py --repeats 3 --epochs 4
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tensorflow_keras_mnist_style.py"


def total_time(n: int, epochs: int, env: dict) -> float:
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(n), str(EXAMPLE), "--epochs",
                          str(epochs), "--warmup_epochs", "1"], env=env, capture_output=True, text=True, check=True)
    match = re.search(r"Hvd Procs (\d+) Total time: ([0-9.]+) second", out.stdout)
    if not match:
        raise SystemExit(f"no total time in the output:\n{out.stdout[-2000:]}")
    return float(match.group(2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="2")
    times: dict[int, list[float]] = {1: [], 2: []}
    for i in range(args.repeats):
        for n in ((1, 2) if i % 2 == 0 else (2, 1)):
            times[n].append(total_time(n, args.epochs, env))
            print(f"Hvd Procs {n} Total time: {times[n][-1]:.2f} second", flush=True)
    print(f"\nseed 002's Keras CNN, {args.epochs} epochs, batch 32 per process; fit time in s")
    print("| processes | runs | median | speed-up |")
    print("|---|---|---|---|")
    one = statistics.median(times[1])
    for n in (1, 2):
        med = statistics.median(times[n])
        print(f"| {n} | {', '.join(f'{t:.2f}' for t in times[n])} | {med:.2f} | {one / med:.2f}x |")


if __name__ == "__main__":
    main()
