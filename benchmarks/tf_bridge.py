"""What the TensorFlow bridge costs: ``ringpipe.tensorflow.allreduce`` of a TF tensor against the torch face's
``hvd.allreduce`` of a torch tensor of the same size, in the same run.

Both run on 2 ranks over the same engine. The variants are timed in blocks of ``--block``
consecutive calls, the order of the blocks rotating from one round to the next so that load on
the machine falls on every variant alike; before each call the ranks meet at a barrier and the
slowest rank's time counts. The TF op is called eagerly and inside a ``tf.function`` (one
``tf.py_function`` node); ``tf.function (no op)`` is the same ``tf.function`` call with
``tf.identity`` in place of the allreduce, TensorFlow's own cost of calling a graph, so that
``tf.function - no op`` is what the collective adds to a graph. Medians with the p10-p90
spread are printed, and the ratios to torch. Every rank prints what it ran; the ratio is
refused when the variants' results differ from ``size * x`` (then they did not do the same
reduction).

    python benchmarks/tf_bridge.py                  # 4 KiB, 4 MiB, 64 MiB; 2 ranks over gloo
    python benchmarks/tf_bridge.py --rounds 8 --block 5
    python benchmarks/tf_bridge.py --variants "tf eager,torch" --block 1 --rounds 1000   # one by one
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
VARIANTS = ("tf eager", "tf.function", "tf.function (no op)", "torch")

WORKER = r"""
import json, os, sys, time
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
import torch
import ringpipe.api as hvd_torch
import ringpipe.tensorflow as hvd

torch.set_num_threads(1)
hvd.init()
rounds, block, sizes, variants = int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5])
fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
empty = tf.function(lambda t: tf.identity(t))
config = {"rank": hvd.rank(), "size": hvd.size(), "backend": "mpi" if hvd.mpi_enabled() else "gloo",
          "tensorflow": tf.__version__, "torch": torch.__version__, "torch threads": torch.get_num_threads(),
          "tf intra/inter threads": [tf.config.threading.get_intra_op_parallelism_threads(),
                                     tf.config.threading.get_inter_op_parallelism_threads()],
          "op": "Sum", "dtype": "float32"}
out = {"config": hvd_torch.allgather_object(config), "sizes": {}}
for size in sizes:
    xt = torch.full((size // 4,), 1.0 + hvd.rank())
    xf = tf.fill([size // 4], 1.0 + hvd.rank())
    calls = {"tf eager": lambda: hvd.allreduce(xf, op=hvd.Sum), "tf.function": lambda: fn(xf),
             "tf.function (no op)": lambda: empty(xf), "torch": lambda: hvd_torch.allreduce(xt, op=hvd_torch.Sum)}
    want = sum(1.0 + r for r in range(hvd.size()))
    results = {}
    for v in variants:  # warm-up (traces the tf.function) and the check that every variant reduced alike
        r = calls[v]()
        r = r.numpy() if hasattr(r, "numpy") else r
        results[v] = "identity" if v == "tf.function (no op)" else bool((r == want).all()) and tuple(r.shape) == (size // 4,)
    times = {v: [] for v in variants}
    for k in range(rounds):
        order = variants[k % len(variants):] + variants[:k % len(variants)]
        for v in (order if k % 2 == 0 else order[::-1]):
            for _ in range(block):
                hvd_torch.barrier()
                t = time.perf_counter()
                calls[v]()
                times[v].append(time.perf_counter() - t)
    for v in variants:  # the slowest rank's time per call
        every = hvd_torch.allgather_object(times[v])
        times[v] = [max(ts) for ts in zip(*every)]
    out["sizes"][str(size)] = {"times": times, "results": hvd_torch.allgather_object(results),
                               "load": os.getloadavg()[0]}
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
    p.add_argument("--rounds", type=int, default=8, help="rounds of blocks (each variant once per round)")
    p.add_argument("--block", type=int, default=5, help="consecutive calls per block")
    p.add_argument("--variants", default=",".join(VARIANTS), help="which variants, comma separated ('torch' always)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes, comma separated")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "torch" not in variants:
        p.error(f"--variants: unknown {unknown} or no 'torch' (the reference); valid: {', '.join(VARIANTS)}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(WORKER)
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(args.ranks), script, result,
               str(args.rounds), str(args.block), json.dumps(sizes), json.dumps(variants)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(result) as f:
            out = json.load(f)
    for config in out["config"]:
        print("ran: " + json.dumps(config))
    print(f"\nallreduce (Sum, float32), {args.ranks} ranks; {args.rounds} rounds x {args.block} calls per variant, "
          "blocks rotating; slowest rank per call; median ms [p10-p90]")
    ratios = [("eager / torch", "tf eager", None), ("tf.function / torch", "tf.function", None),
              ("(tf.function - no op) / torch", "tf.function", "tf.function (no op)")]
    ratios = [r for r in ratios if r[1] in variants and (r[2] is None or r[2] in variants)]
    print("| size | load | " + " | ".join(variants) + " | " + " | ".join(r[0] for r in ratios) + " |")
    print("|" + "---|" * (len(variants) + len(ratios) + 2))
    for size in sizes:
        entry = out["sizes"][str(size)]
        t = entry["times"]
        med = {v: statistics.median(t[v]) * 1e3 for v in variants}
        cells = [f"{med[v]:.3f} [{_q(t[v], 0.1) * 1e3:.3f}-{_q(t[v], 0.9) * 1e3:.3f}]" for v in variants]
        label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        bad = sorted({v for r in entry["results"] for v, ok in r.items() if ok is False})
        if bad:
            shown = [f"no ratio: {', '.join(bad)} did not return size * x"] * len(ratios)
        else:
            shown = [f"{(med[a] - (med[b] if b else 0.0)) / med['torch']:.2f}" for _, a, b in ratios]
        print(f"| {label} | {entry['load']:.1f} | {' | '.join(cells)} | {' | '.join(shown)} |")


if __name__ == "__main__":
    main()
