"""Where the eager TF face's extra time per small call goes: warm loops, cold calls, and stage stamps.

Three measurements of ``ringpipe.tensorflow.allreduce`` of a 4 KiB float32 tensor against the
torch face's ``hvd.allreduce`` of a torch tensor of the same size:

- ``--mode loop``: one rank, each call back to back (warm code), best of 5 loops of 3,000 calls;
- ``--mode cold``: one process, no collective; the bridge's pieces (``to_torch``, ``to_tf``) and
  plain calls timed one at a time after a 2 ms sleep, as a rank's calling thread wakes from the
  engine's wait between two calls (median of 500);
- ``--mode stamps``: 2 ranks, the two calls alternating one by one with a barrier before each,
  and rank 0's time stamped where the TF face enters ``to_torch``, hands the task to the engine,
  wakes from it and leaves ``to_tf`` (median of 1,400 calls after 100 warm-up ones, µs).

    python benchmarks/tf_bridge_cold.py --mode stamps
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

COMMON = r"""
import statistics, sys, time
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
import torch
torch.set_num_threads(1)
import ringpipe.api as hvd_torch
import ringpipe.tensorflow as hvd
from ringpipe.tensorflow import bridge, mpi_ops
hvd.init()
xf, xt = tf.fill([1024], 1.0), torch.full((1024,), 1.0)
tf_call = lambda: hvd.allreduce(xf, op=hvd.Sum)
torch_call = lambda: hvd_torch.allreduce(xt, op=hvd_torch.Sum)
"""

LOOP = COMMON + r"""
def best(f, n=3000):
    for _ in range(200):
        f()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t) / n * 1e6)
    return min(times)
for _ in range(2):
    print(f"warm loop, one rank: tf eager {best(tf_call):.1f} us, torch {best(torch_call):.1f} us")
"""

COLD = COMMON + r"""
def cold(f, n=500):
    times = []
    for _ in range(n):
        time.sleep(0.002)
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6
pieces = {"torch.ones(3).clone()": lambda: torch.ones(3).clone(), "tf.convert_to_tensor": lambda: tf.convert_to_tensor(xf),
          "bridge.to_torch": lambda: bridge.to_torch(xf), "bridge.to_tf": lambda: bridge.to_tf(xt)}
for _ in range(3):
    print("after a 2 ms sleep (us): " + ", ".join(f"{k} {cold(f):.1f}" for k, f in pieces.items()))
"""

STAMPS = COMMON + r"""
from ringpipe.core import engine
stamp = {}
def stamped(name, fn, before=True):
    def call(*a, **k):
        if before:
            stamp[name] = time.perf_counter()
        out = fn(*a, **k)
        if not before:
            stamp[name] = time.perf_counter()
        return out
    return call
engine.Engine.submit = stamped("submit", engine.Engine.submit)
engine.Handle.wait = stamped("woke", engine.Handle.wait, before=False)
mpi_ops.to_torch = stamped("to_torch", mpi_ops.to_torch)
mpi_ops.to_tf = stamped("to_tf done", mpi_ops.to_tf, before=False)
calls = {"tf": tf_call, "torch": torch_call}
stages = {k: {"before the engine": [], "engine": [], "after the engine": []} for k in calls}
tf_parts = {"wrappers (call to to_torch)": [], "to_torch to submit": [], "woke to to_tf done": [], "return": []}
for i in range(1500):
    for k in (list(calls) if i % 2 else list(calls)[::-1]):
        hvd_torch.barrier()
        t = time.perf_counter()
        calls[k]()
        end = time.perf_counter()
        if i < 100:
            continue
        stages[k]["before the engine"].append(stamp["submit"] - t)
        stages[k]["engine"].append(stamp["woke"] - stamp["submit"])
        stages[k]["after the engine"].append(end - stamp["woke"])
        if k == "tf":
            tf_parts["wrappers (call to to_torch)"].append(stamp["to_torch"] - t)
            tf_parts["to_torch to submit"].append(stamp["submit"] - stamp["to_torch"])
            tf_parts["woke to to_tf done"].append(stamp["to_tf done"] - stamp["woke"])
            tf_parts["return"].append(end - stamp["to_tf done"])
if hvd.rank() == 0:
    med = lambda v: f"{statistics.median(v) * 1e6:.0f}"
    for k, parts in stages.items():
        print(f"{k}: " + ", ".join(f"{name} {med(v)}" for name, v in parts.items()) + " (us, rank 0)")
    print("tf face's parts: " + ", ".join(f"{name} {med(v)}" for name, v in tf_parts.items()) + " (us)")
hvd.shutdown()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("loop", "cold", "stamps"), default="stamps")
    args = p.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write({"loop": LOOP, "cold": COLD, "stamps": STAMPS}[args.mode])
        launch = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2"] if args.mode == "stamps" else [sys.executable]
        subprocess.run([*launch, script], env=env, check=True)


if __name__ == "__main__":
    main()
