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
- ``inline engine in py_function``: the node runs the torch face's allreduce task (the
  announcement, which the data rides when it fits, else the data after it) on its own thread when the engine is idle (``Engine.submit(inline=True)``)
  instead of handing it to the engine thread;
- ``grouped tf.function``, ``grouped inline engine in py_function``, ``grouped torch``: the
  8 gradients of ``tf_tape_vs_mwms.py``'s CNN (38,282 float32) as its step reduces them (one
  grouped allreduce in ``tf.function``), the same with the engine task inline, and the torch
  face's ``grouped_allreduce_`` of torch tensors of the same shapes;
- ``raw gloo``, ``two raw gloo``, ``two raw gloo overlapped``, ``announce only``, ``torch``,
  ``torch inline engine``: from the calling thread, the communicator's allreduce alone (its own
  cross-rank check off), two of them in a row, a header-sized one and the data posted back to
  back, the announcement alone, the torch face's allreduce, and its task run inline.

With ``--stamps`` the full ``tf.function`` variant also records, per call, the time from the
call to the ``py_function`` body's entry, to the engine task's start, to the announcement's end,
to the data's end, to the body's exit and to the call's return (rank 0's clock).

With ``--cpu N`` each variant is also called N times in a row (twice, in alternating order) and
the CPU time of each thread of rank 0 is reported per call (``/proc/self/task``; TensorFlow's
pool threads appear as ``Dummy-*``, gloo's as ``gloo_tcp_loop`` / ``pt_gloo_runloop``). With
``--ranks 1`` the collectives have no peer: the machinery's fixed costs.

    python benchmarks/tf_graph_cost.py --stamps --cpu 100          # 4 KiB, 2 ranks
    python benchmarks/tf_graph_cost.py --size 153128 --stamps       # the tape's gradient size
    python benchmarks/tf_graph_cost.py --ranks 1                    # fixed costs
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
            "tf eager", "raw gloo", "two raw gloo", "two raw gloo overlapped", "announce only", "torch", "torch inline engine",
            "grouped tf.function", "grouped inline engine in py_function", "grouped torch")

WORKER = r"""
import json, os, sys, threading, time
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
import torch
import ringpipe.api as hvd_torch
import ringpipe.tensorflow as hvd
from ringpipe.core.calls import Call
from ringpipe.comm.base import ReduceOp
from ringpipe.core import ops as core_ops
from ringpipe.check.announcement import announce, checks
from ringpipe.core.engine import Engine
from ringpipe.tensorflow import bridge

torch.set_num_threads(1)
hvd.init()
out_path, rounds, block, size, variants, stamps = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                                   json.loads(sys.argv[5]), sys.argv[6] == "1")
cpu_calls = int(sys.argv[7])
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
    # the task of the torch face's allreduce (ringpipe.core.ops.allreduce_inplace), run on the calling
    # thread when the engine is idle (Engine.submit(inline=True)) instead of on the engine thread
    y = x.clone()
    def task():
        return core_ops.reduce_announced(comm, y, ReduceOp.SUM, ReduceOp.SUM, 1.0, {"process_set": 0},
                                       checks(comm, "allreduce", y))
    core_ops.finish_reduction(engine.submit(task, inline=True).wait())
    return y

def inline_tf(v):
    return bridge.to_tf(inline(bridge.to_torch(v)))

# the gradients of the Keras CNN of benchmarks/tf_tape_vs_mwms.py (38,282 float32), as its step reduces them
SHAPES = [(3, 3, 1, 16), (16,), (3, 3, 16, 32), (32,), (512, 64), (64,), (64, 10), (10,)]
grads_tf = [tf.fill(s, 1.0 + hvd.rank()) for s in SHAPES]
grads_torch = [torch.full(s, 1.0 + hvd.rank()) for s in SHAPES]

def inline_group(*vs):
    # the task of the torch face's grouped allreduce (one fused message), run inline as above
    ts = [bridge.to_torch(v) for v in vs]
    flat = torch.cat([t.reshape(-1) for t in ts])
    def task():
        return core_ops.reduce_announced(comm, flat, ReduceOp.SUM, ReduceOp.SUM, 1.0,
                                       {"process_set": 0, "shapes": [list(t.shape) for t in ts]},
                                       checks(comm, "grouped_allreduce"))
    core_ops.finish_reduction(engine.submit(task, inline=True).wait())
    return [bridge.to_tf(p.view(t.shape)) for p, t in zip(flat.split([t.numel() for t in ts]), ts)]

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
dnc = tf.autograph.experimental.do_not_convert
grouped = tf.function(lambda: hvd.grouped_allreduce(grads_tf, op=hvd.Sum))
grouped_inline = tf.function(dnc(lambda: bridge.run(inline_group, grads_tf, [g.dtype for g in grads_tf],
                                                    [g.shape for g in grads_tf])))
calls["grouped tf.function"] = lambda: grouped()
calls["grouped inline engine in py_function"] = lambda: grouped_inline()
calls["grouped torch"] = lambda: hvd_torch.grouped_allreduce_([g.clone() for g in grads_torch], op=hvd_torch.Sum)
calls["tf eager"] = lambda: hvd.allreduce(xf, op=hvd.Sum)
calls["raw gloo"] = lambda: raw(None)
calls["two raw gloo"] = two_raw
calls["two raw gloo overlapped"] = two_raw_overlapped
calls["torch inline engine"] = lambda: inline(xt)
calls["announce only"] = lambda: engine.run(lambda: announce(comm, "allreduce", xt, ReduceOp.SUM, {"process_set": 0}))
calls["torch"] = lambda: hvd_torch.allreduce(xt, op=hvd_torch.Sum)

marks = []
if stamps:
    real_announce, real_finish = core_ops.announce, core_ops.finish_reduction
    def stamped_announce(*a, **k):
        marks.append(("task", time.perf_counter_ns()))
        r = real_announce(*a, **k)
        marks.append(("announced", time.perf_counter_ns()))
        return r
    def stamped_finish(p):
        r = real_finish(p)
        marks.append(("data", time.perf_counter_ns()))
        return r
    core_ops.announce, core_ops.finish_reduction = stamped_announce, stamped_finish
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
for v in ("grouped tf.function", "grouped inline engine in py_function", "grouped torch"):
    assert all(float(tf.reduce_min(g)) == float(tf.reduce_max(g)) == want for g in calls[v]()), v
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


def thread_ticks():
    # CPU time of every thread of this process (user + system, clock ticks), by thread name
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm_name = f.read().strip()
        except OSError:
            continue
        out[(tid, names.get(int(tid), comm_name))] = int(fields[11]) + int(fields[12])
    return out


cpu = {v: {} for v in variants}
for k in range(2 if cpu_calls else 0):  # consecutive calls, no barrier between them (a barrier is a collective too)
    for v in (variants if k % 2 == 0 else variants[::-1]):
        hvd_torch.barrier()
        before = thread_ticks()
        for _ in range(cpu_calls):
            calls[v]()
        after = thread_ticks()
        for key, ticks in after.items():
            if ticks - before.get(key, 0):
                cpu[v][key[1]] = cpu[v].get(key[1], 0) + ticks - before.get(key, 0)
tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
cpu = {v: {name: ticks * tick_ms / (2 * cpu_calls) for name, ticks in by.items()} for v, by in cpu.items()}
if hvd.rank() == 0:
    with open(out_path, "w") as f:
        json.dump({"times": times, "stamps": stamp_rows, "load": os.getloadavg()[0], "cpu": cpu}, f)
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
    p.add_argument("--ranks", type=int, default=2, help="1: the machinery's fixed costs without a peer")
    p.add_argument("--cpu", type=int, default=0, metavar="N",
                   help="also N consecutive calls per variant (twice) with the CPU time of each thread (rank 0)")
    args = p.parse_args()
    variants = args.variants.split(",")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(WORKER)
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(args.ranks), script, result, str(args.rounds),
               str(args.block), str(args.size), json.dumps(variants), "1" if args.stamps else "0", str(args.cpu)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(result) as f:
            out = json.load(f)
    print(f"{args.size} bytes float32 Sum, {args.ranks} rank(s) gloo, {args.rounds} rounds x {args.block} calls, slowest rank; "
          f"load {load0:.1f} before, {out['load']:.1f} at the end")
    cpu = out["cpu"] if args.cpu else {}
    print("| variant | median ms | p10-p90 |" + (" CPU ms per call, all threads | by thread |" if cpu else ""))
    print("|---|---|---|" + ("---|---|" if cpu else ""))
    for v in variants:
        t = out["times"][v]
        row = f"| {v} | {statistics.median(t) * 1e3:.3f} | {_q(t, 0.1) * 1e3:.3f}-{_q(t, 0.9) * 1e3:.3f} |"
        if cpu:
            by = sorted(cpu[v].items(), key=lambda kv: -kv[1])
            row += f" {sum(cpu[v].values()):.2f} | " + ", ".join(f"{n} {ms:.2f}" for n, ms in by if ms >= 0.01) + " |"
        print(row)
    if out["stamps"]:
        keys = ["body", "task", "announced", "data", "body exit", "return"]
        print("\nstages of the tf.function call (rank 0, ms since the call; median [p10-p90])")
        for k in keys:
            xs = [r[k] for r in out["stamps"] if k in r]
            if xs:
                print(f"  {k:10s} {statistics.median(xs):.3f} [{_q(xs, 0.1):.3f}-{_q(xs, 0.9):.3f}]")


if __name__ == "__main__":
    main()
