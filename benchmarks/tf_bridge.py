"""What the TensorFlow bridge costs: ``ringpipe.tensorflow.allreduce`` of a TF tensor against the torch face's
``hvd.allreduce`` of a torch tensor of the same size, in the same run.

Both run on 2 ranks over the same engine. Per iteration the ranks meet at a barrier, then each
variant is timed once, alternating (TF, torch, torch, TF, ...) so that load on the machine falls
on both alike; the slowest rank's time counts. The TF op is called eagerly and inside a
``tf.function`` (one ``tf.py_function`` node). Medians with the 10th-90th percentile spread are
printed, and the ratio TF / torch.

    python benchmarks/tf_bridge.py                  # 4 KiB, 4 MiB, 64 MiB; 2 ranks over gloo
    python benchmarks/tf_bridge.py --iters 40 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SIZES = [4 << 10, 4 << 20, 64 << 20]
VARIANTS = ("tf eager", "tf.function", "torch")

WORKER = r"""
import json, sys, time
import tensorflow as tf
import torch
import ringpipe.api as hvd_torch
import ringpipe.tensorflow as hvd

torch.set_num_threads(1)
hvd.init()
iters, warmup, sizes = int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
variants = json.loads(sys.argv[5])
fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
out = {}
for size in sizes:
    xt = torch.ones(size // 4)
    xf = tf.ones([size // 4])
    calls = {"tf eager": lambda: hvd.allreduce(xf, op=hvd.Sum), "tf.function": lambda: fn(xf),
             "torch": lambda: hvd_torch.allreduce(xt, op=hvd_torch.Sum)}
    times = {v: [] for v in variants}
    for i in range(warmup + iters):
        order = variants if i % 2 == 0 else variants[::-1]
        for v in order:
            hvd_torch.barrier()
            t = time.perf_counter()
            calls[v]()
            dt = time.perf_counter() - t
            if i >= warmup:
                times[v].append(dt)
    # the slowest rank's time per iteration
    for v in variants:
        every = hvd_torch.allgather_object(times[v])
        times[v] = [max(ts) for ts in zip(*every)]
    out[str(size)] = times
if hvd.rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
hvd.shutdown()
"""


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="2")
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(WORKER)
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(args.ranks), script, result,
               str(args.iters), str(args.warmup), json.dumps(SIZES), json.dumps(list(VARIANTS))]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(result) as f:
            out = json.load(f)
    print(f"allreduce (Sum), {args.ranks} ranks, gloo; {args.iters} iterations; median ms [p10-p90]")
    print("| size | tf eager | tf.function | torch | tf eager / torch | tf.function / torch |")
    print("|---|---|---|---|---|---|")
    for size in SIZES:
        t = out[str(size)]
        med = {v: statistics.median(t[v]) * 1e3 for v in VARIANTS}
        cells = [f"{med[v]:.3f} [{_q(t[v], 0.1) * 1e3:.3f}-{_q(t[v], 0.9) * 1e3:.3f}]" for v in VARIANTS]
        label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        print(f"| {label} | {' | '.join(cells)} | {med['tf eager'] / med['torch']:.2f} | "
              f"{med['tf.function'] / med['torch']:.2f} |")


if __name__ == "__main__":
    main()
