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
    python benchmarks/tf_bridge.py --quick          # seconds: 4 KiB, one round of one call per variant

Dropped: ``tf_bridge_cold.py`` (where the eager face's time per small call went, by stamps patched
into the engine) and ``tf_graph_cost.py`` (the same inside ``tf.function``, a ladder of graphs
built from the engine's and the announcement's private functions): diagnostics of a finished
investigation that patched internals this redesign moves; their figures stay in HISTORY.md, and
``git show 27393d1:benchmarks/tf_graph_cost.py`` (or ``tf_bridge_cold.py``) gives them back as they
were then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import procs, report, stats  # noqa: E402
from lib import sizes as sizes_

__all__ = ["main"]

SIZES = [4 << 10, 4 << 20, 64 << 20]
VARIANTS = ("tf eager", "tf.function", "tf.function (no op)", "torch")

WORKER = r"""
import json, os, sys, time
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
import torch
import ringpipe as hvd_torch
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8, help="rounds of blocks (each variant once per round)")
    p.add_argument("--block", type=int, default=5, help="consecutive calls per block")
    p.add_argument("--variants", default=",".join(VARIANTS), help="which variants, comma separated ('torch' always)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes, comma separated")
    p.add_argument("--quick", action="store_true", help="seconds: 4 KiB, 2 ranks, one round of one call")
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.rounds, args.block, args.sizes = 2, 1, 1, str(4 << 10)
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "torch" not in variants:
        p.error(f"--variants: unknown {unknown} or no 'torch' (the reference); valid: {', '.join(VARIANTS)}")
    report.header("tf_bridge", argv)
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(WORKER)
        procs.run(procs.ringpipe_cli("launch", "-n", str(args.ranks), script, result, str(args.rounds),
                                     str(args.block), json.dumps(sizes), json.dumps(variants)), 3600, env)
        with open(result) as f:
            out = json.load(f)
    for config in out["config"]:
        print("ran: " + json.dumps(config))
    print(f"\nallreduce (Sum, float32), {args.ranks} ranks; {args.rounds} rounds x {args.block} calls per variant, "
          "blocks rotating; slowest rank per call; median ms (p10-p90)\n")
    ratios = [("eager / torch", "tf eager", None), ("tf.function / torch", "tf.function", None),
              ("(tf.function - no op) / torch", "tf.function", "tf.function (no op)")]
    ratios = [r for r in ratios if r[1] in variants and (r[2] is None or r[2] in variants)]
    rows, headline = [], []
    for size in sizes:
        entry = out["sizes"][str(size)]
        t = entry["times"]
        sp = {v: stats.spread(t[v], "p10-p90") for v in variants}
        med = {v: sp[v].median * 1e3 for v in variants}
        bad = sorted({v for r in entry["results"] for v, ok in r.items() if ok is False})
        if bad:
            shown = [f"no ratio: {', '.join(bad)} did not return size * x"] * len(ratios)
        else:
            shown = [f"{(med[a] - (med[b] if b else 0.0)) / med['torch']:.2f}" for _, a, b in ratios]
            for name, a, b in ratios:
                if b is None:
                    headline.append((f"ringpipe.tensorflow.allreduce, {name.split(' /')[0]}, {sizes_.label(size)}, "
                                     f"{args.ranks} ranks", "the torch face's hvd.allreduce (same engine)",
                                     stats.Spread(sp[a].median / sp["torch"].median, sp[a].low / sp["torch"].median,
                                                  sp[a].high / sp["torch"].median, "p10-p90 over torch's median")))
        rows.append((sizes_.label(size), f"{entry['load']:.1f}", *(sp[v].fmt(3, 1e3) for v in variants), *shown))
    print(report.table(("size", "load", *variants, *(r[0] for r in ratios)), rows))
    if headline:
        report.headline(headline)
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
