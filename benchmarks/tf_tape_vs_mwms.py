"""A ``DistributedGradientTape`` training step against TensorFlow's own ``MultiWorkerMirroredStrategy``.

Same model (seed 002's Keras CNN on the 8x8 digits), same data, same per-worker batch, same
threads, 2 worker processes on this machine. ringpipe's side runs under ``ringpipe launch``;
TensorFlow's side starts its workers with a ``TF_CONFIG`` cluster on localhost (its collectives
over gRPC/RING). Each run times ``--steps`` training steps after ``--warmup`` and reports the
median step time of rank 0 (the steps synchronize the workers). Runs alternate, ringpipe first,
``--repeats`` times; the table gives each run's median and the median over runs.

    python benchmarks/tf_tape_vs_mwms.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


def _model():  # noqa: ANN202
    import keras

    keras.utils.set_random_seed(1234)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
        keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def _data(rank: int, size: int):  # noqa: ANN202
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int64")
    return np.ascontiguousarray(x[rank::size]), np.ascontiguousarray(y[rank::size])


def _time_steps(step, x, y, batch: int, steps: int, warmup: int) -> list[float]:  # noqa: ANN001
    times = []
    n = len(x) // batch
    for i in range(warmup + steps):
        k = i % n
        t = time.perf_counter()
        step(x[k * batch : (k + 1) * batch], y[k * batch : (k + 1) * batch])
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def worker_ringpipe(out: str, batch: int, steps: int, warmup: int) -> None:
    import keras
    import tensorflow as tf

    import ringpipe.tensorflow as hvd

    hvd.init()
    x, y = _data(hvd.rank(), hvd.size())
    model = _model()
    opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(bx, by):  # noqa: ANN001, ANN202
        with tf.GradientTape() as tape:
            loss = loss_fn(by, model(bx, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    times = _time_steps(step, x, y, batch, steps, warmup)
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    hvd.shutdown()


def worker_mwms(out: str, batch: int, steps: int, warmup: int) -> None:
    import keras
    import tensorflow as tf

    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    size = strategy.num_replicas_in_sync
    x, y = _data(rank, size)
    with strategy.scope():
        model = _model()
        opt = keras.optimizers.SGD(0.01 * size, momentum=0.9)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(bx, by):  # noqa: ANN001, ANN202
        def replica(bx, by):  # noqa: ANN001, ANN202
            with tf.GradientTape() as tape:
                per_example = loss_fn(by, model(bx, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch * size)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))  # summed over replicas
            return loss

        return strategy.run(replica, args=(bx, by))

    times = _time_steps(step, x, y, batch, steps, warmup)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run(side: str, batch: int, steps: int, warmup: int, env: dict) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        args = ["--worker", side, "--out", out, "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
        if side == "ringpipe":
            subprocess.run([sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", HERE, *args], env=env,
                           check=True, stdout=subprocess.DEVNULL)
        else:
            ports = _free_ports(2)
            cluster = {"worker": [f"localhost:{p}" for p in ports]}
            procs = [subprocess.Popen([sys.executable, HERE, *args], stdout=subprocess.DEVNULL,
                                      env=dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                                                          "task": {"type": "worker", "index": i}})))
                     for i in range(2)]
            codes = [p.wait(timeout=900) for p in procs]
            if any(codes):
                raise SystemExit(f"MultiWorkerMirroredStrategy workers exited with {codes}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=["ringpipe", "mwms"])
    p.add_argument("--out")
    p.add_argument("--batch", type=int, default=32, help="per-worker batch")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.worker == "ringpipe":
        return worker_ringpipe(args.out, args.batch, args.steps, args.warmup)
    if args.worker == "mwms":
        return worker_mwms(args.out, args.batch, args.steps, args.warmup)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="2")
    medians: dict[str, list[float]] = {"ringpipe": [], "mwms": []}
    for _ in range(args.repeats):
        for side in ("ringpipe", "mwms"):
            medians[side].append(statistics.median(_run(side, args.batch, args.steps, args.warmup, env)) * 1e3)
            print(f"{side}: median step {medians[side][-1]:.2f} ms", flush=True)
    r, m = statistics.median(medians["ringpipe"]), statistics.median(medians["mwms"])
    print(f"\n2 workers, batch {args.batch} per worker, {args.steps} steps after {args.warmup}; median step ms per run")
    print("| side | runs | median of runs |")
    print("|---|---|---|")
    print(f"| ringpipe DistributedGradientTape | {', '.join(f'{v:.2f}' for v in medians['ringpipe'])} | {r:.2f} |")
    print(f"| tf MultiWorkerMirroredStrategy | {', '.join(f'{v:.2f}' for v in medians['mwms'])} | {m:.2f} |")
    print(f"ratio ringpipe / MWMS: {r / m:.2f}")


if __name__ == "__main__":
    main()
