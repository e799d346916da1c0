"""Where the time of a collective inside ``tf.function`` goes: a ladder of graphs, each adding one stage.

2 ranks over gloo. Each variant is a call timed from the calling thread, in blocks of ``--block``
calls whose order rotates from round to round; the ranks meet at a barrier before each call and
the slowest rank's time counts. The ladder (4 KiB float32 unless ``--size``):

- ``identity``: ``tf.function`` of ``tf.identity``, TensorFlow's cost of calling a graph;
- ``py_function empty``: one ``tf.py_function`` node returning its input;
- ``numpy_function empty``: one ``tf.numpy_function`` node returning its input;
- ``py_function bridge``: the node crosses to torch and back (DLPack), no collective;
- ``bridge + status``: the same through ``bridge.run`` (the ``RingpipeStatus`` node and the
  ``tf.identity`` reads), no collective;
- ``raw gloo in py_function``: the node calls the communicator's allreduce itself (no engine,
  no announcement);
- ``torch api in py_function``: the node calls the torch face's allreduce on a torch tensor;
- ``tf.function``: ``ringpipe.tensorflow.allreduce`` inside ``tf.function``;
- ``tf eager``: the same op eagerly;
- ``inline engine in py_function``: the node runs the torch face's allreduce task (announcement,
  then the data) on its own thread when the engine is idle (``Engine.submit(inline=True)``)
  instead of handing it to the engine thread;
- ``raw gloo``, ``two raw gloo``, ``two raw gloo overlapped``, ``announce only``, ``torch``,
  ``torch inline engine``: from the calling thread, the communicator's allreduce alone (its own
  cross-rank check off), two of them in a row, a header-sized one and the data posted back to
  back, the announcement alone, the torch face's allreduce, and its task run inline.

With ``--stamps`` the full ``tf.function`` variant also records, per call, the time from the
call to the ``py_function`` body's entry, to the engine task's start, to the announcement's end,
to the data's end, to the body's exit and to the call's return (rank 0's clock).

    python benchmarks/tf_graph_cost.py                      # 4 KiB
    python benchmarks/tf_graph_cost.py --size 4194304 --stamps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

VARIANTS = ("identity", "py_function empty", "numpy_function empty", "py_function bridge", "bridge + status",
            "raw gloo in py_function", "torch api in py_function", "inline engine in py_function", "tf.function",
            "tf eager", "raw gloo", "two raw gloo", "two raw gloo overlapped", "announce only", "torch", "torch inline engine")

WORKER = r"""
import json, os, sys, time
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
import torch
import ringpipe.api as hvd_torch
import ringpipe.tensorflow as hvd
from ringpipe.api.calls import Call
from ringpipe.comm.base import ReduceOp
from ringpipe.dp import ops as dp_ops
from ringpipe.dp.announce import announce, checks
from ringpipe.dp.engine import Engine
from ringpipe.tensorflow import bridge

torch.set_num_threads(1)
hvd.init()
out_path, rounds, block, size, variants, stamps = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                                   json.loads(sys.argv[5]), sys.argv[6] == "1")
comm = Call("allreduce", None, None).comm
engine = Engine.of(comm)
n = size // 4
xt = torch.full((n,), 1.0 + hvd.rank())
xf = tf.fill([n], 1.0 + hvd.rank())
spare = torch.empty(n)

def raw(v):
    spare.copy_(xt)
    with comm.unchecked():  # the communicator's own cross-rank check off: the data allreduce alone
        comm.allreduce(spare, ReduceOp.SUM)
    return v

def torch_api(v):
    hvd_torch.allreduce(xt, op=hvd_torch.Sum)
    return v

def inline(x):
    # the task of the torch face's allreduce (ringpipe.dp.ops.allreduce_inplace), run on the calling
    # thread when the engine is idle (Engine.submit(inline=True)) instead of on the engine thread
    y = x.clone()
    def task():
        announce(comm, "allreduce", y, ReduceOp.SUM, {"process_set": 0}, checks(comm, "allreduce", y))
        dp_ops.finish_reduction(dp_ops.start_reduction(comm, y, ReduceOp.SUM))
        return y
    return engine.submit(task, inline=True).wait()

def inline_tf(v):
    return bridge.to_tf(inline(bridge.to_torch(v)))

def two_raw():
    spare.copy_(xt)
    with comm.unchecked():
        comm.allreduce(spare, ReduceOp.SUM)
        comm.allreduce(spare, ReduceOp.SUM)

other = torch.zeros(64)

def two_raw_overlapped():
    # a small message and the data posted back to back, then both waited (the optimizer's step
    # does this with its announcement; a plain allreduce announces first and then sends the data)
    spare.copy_(xt)
    with comm.unchecked():
        first = comm.iallreduce(other, ReduceOp.SUM)
        second = comm.iallreduce(spare, ReduceOp.SUM)
        first.wait()
        second.wait()

def bridge_only(v):
    return bridge.to_tf(bridge.to_torch(v))

def with_status(t):
    return bridge.run(lambda v: [bridge.to_tf(bridge.to_torch(v))], [t], [t.dtype], [t.shape], name="Probe")[0]

graphs = {
    "identity": tf.function(lambda t: tf.identity(t)),
    "py_function empty": tf.function(lambda t: tf.py_function(lambda v: v, [t], t.dtype)),
    "numpy_function empty": tf.function(lambda t: tf.numpy_function(lambda v: v, [t], t.dtype, stateful=True)),
    "py_function bridge": tf.function(lambda t: tf.py_function(bridge_only, [t], t.dtype)),
    "bridge + status": tf.function(tf.autograph.experimental.do_not_convert(with_status)),
    "raw gloo in py_function": tf.function(lambda t: tf.py_function(raw, [t], t.dtype)),
    "torch api in py_function": tf.function(lambda t: tf.py_function(torch_api, [t], t.dtype)),
    "inline engine in py_function": tf.function(lambda t: tf.py_function(inline_tf, [t], t.dtype)),
    "tf.function": tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum)),
}
calls = {k: (lambda g=g: g(xf)) for k, g in graphs.items()}
calls["tf eager"] = lambda: hvd.allreduce(xf, op=hvd.Sum)
calls["raw gloo"] = lambda: raw(None)
calls["two raw gloo"] = two_raw
calls["two raw gloo overlapped"] = two_raw_overlapped
calls["torch inline engine"] = lambda: inline(xt)
calls["announce only"] = lambda: engine.run(lambda: announce(comm, "allreduce", xt, ReduceOp.SUM, {"process_set": 0}))
calls["torch"] = lambda: hvd_torch.allreduce(xt, op=hvd_torch.Sum)

marks = []
if stamps:
    real_announce, real_finish = dp_ops.announce, dp_ops.finish_reduction
    def stamped_announce(*a, **k):
        marks.append(("task", time.perf_counter_ns()))
        r = real_announce(*a, **k)
        marks.append(("announced", time.perf_counter_ns()))
        return r
    def stamped_finish(p):
        r = real_finish(p)
        marks.append(("data", time.perf_counter_ns()))
        return r
    dp_ops.announce, dp_ops.finish_reduction = stamped_announce, stamped_finish
    real_run = bridge.run
    def stamped_run(fn, inputs, tout, shapes, name="ringpipe"):
        def wrapped(*xs):
            marks.append(("body", time.perf_counter_ns()))
            r = fn(*xs)
            marks.append(("body exit", time.perf_counter_ns()))
            return r
        return real_run(wrapped, inputs, tout, shapes, name)
    import ringpipe.tensorflow.mpi_ops as mo
    mo.run = stamped_run
    graphs["tf.function"] = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
    calls["tf.function"] = lambda: graphs["tf.function"](xf)

want = float(sum(1.0 + r for r in range(hvd.size())))
for v in variants:
    calls[v]()
r = calls["tf.function"]().numpy()
assert (r == want).all(), r[:4]
marks.clear()
times = {v: [] for v in variants}
stamp_rows = []
for k in range(rounds):
    order = variants[k % len(variants):] + variants[:k % len(variants)]
    for v in (order if k % 2 == 0 else order[::-1]):
        for _ in range(block):
            hvd_torch.barrier()
            marks.clear()
            t = time.perf_counter_ns()
            calls[v]()
            e = time.perf_counter_ns()
            times[v].append((e - t) / 1e9)
            if stamps and v == "tf.function":
                row = {name: (at - t) / 1e6 for name, at in marks}
                row["return"] = (e - t) / 1e6
                stamp_rows.append(row)
for v in variants:
    every = hvd_torch.allgather_object(times[v])
    times[v] = [max(ts) for ts in zip(*every)]
if hvd.rank() == 0:
    with open(out_path, "w") as f:
        json.dump({"times": times, "stamps": stamp_rows, "load": os.getloadavg()[0]}, f)
hvd.shutdown()
"""


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--size", type=int, default=4 << 10, help="bytes of float32")
    p.add_argument("--stamps", action="store_true", help="stage stamps of the full tf.function variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    variants = args.variants.split(",")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(WORKER)
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", script, result, str(args.rounds),
               str(args.block), str(args.size), json.dumps(variants), "1" if args.stamps else "0"]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(result) as f:
            out = json.load(f)
    print(f"{args.size} bytes float32 Sum, 2 ranks gloo, {args.rounds} rounds x {args.block} calls, slowest rank; "
          f"load {load0:.1f} before, {out['load']:.1f} at the end")
    print("| variant | median ms | p10-p90 |")
    print("|---|---|---|")
    for v in variants:
        t = out["times"][v]
        print(f"| {v} | {statistics.median(t) * 1e3:.3f} | {_q(t, 0.1) * 1e3:.3f}-{_q(t, 0.9) * 1e3:.3f} |")
    if out["stamps"]:
        keys = ["body", "task", "announced", "data", "body exit", "return"]
        print("\nstages of the tf.function call (rank 0, ms since the call; median [p10-p90])")
        for k in keys:
            xs = [r[k] for r in out["stamps"] if k in r]
            if xs:
                print(f"  {k:10s} {statistics.median(xs):.3f} [{_q(xs, 0.1):.3f}-{_q(xs, 0.9):.3f}]")


if __name__ == "__main__":
    main()
