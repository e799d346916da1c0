"""A ``DistributedGradientTape`` training step against TensorFlow's own ``MultiWorkerMirroredStrategy``.

Same model (seed 002's Keras CNN on the 8x8 digits), same data shards, same per-worker batch,
same optimizer, same threads (``tf.config.threading`` set explicitly on both sides, and
``OMP_NUM_THREADS=1`` / one torch thread for ringpipe's engine), 2 worker processes on this
machine. ringpipe's side runs under ``ringpipe launch``; TensorFlow's side starts its workers
with a ``TF_CONFIG`` cluster on localhost (its collectives over gRPC, RING).

Each run trains ``--steps`` steps after ``--warmup`` and times them in blocks of
``--block`` consecutive training steps; between blocks it times, on the same worker, the
parts of a step: ``local`` (forward, backward and apply on a copy of the model, no
communication) and ``reduce`` (the side's collective on gradient-shaped tensors, inside
``tf.function``); on ringpipe's side also ``reduce_torch``, the same reduction through the
torch face from the calling thread, no graph (what the engine and gloo cost without
TensorFlow's graph around them). Runs alternate between the sides in ABBA order, ``--repeats`` pairs.

Each side prints what it ran (versions, threads, model size, batch, optimizer, a checksum of
the initial weights) and its per-step losses. The ratio is refused when the two sides did not
do the same work: a different configuration, different initial weights, or losses that part
beyond float tolerance (the two sides train the same model on the same global batch, so their
losses agree step by step).

    python benchmarks/tf_tape_vs_mwms.py --repeats 2
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import procs, report, stats  # noqa: E402

__all__ = ["main"]

HERE = os.path.abspath(__file__)
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1"}


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

    from ringpipe.train.datasets import digits_arrays

    images, y = digits_arrays()
    x = images[..., None] / np.float32(16.0)
    return np.ascontiguousarray(x[rank::size]), np.ascontiguousarray(y[rank::size])


def _threads(args: argparse.Namespace) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.intra)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter)


def _config(side: str, model, size: int, args: argparse.Namespace) -> dict:  # noqa: ANN001
    import keras
    import numpy as np
    import tensorflow as tf

    return {
        "tensorflow": tf.__version__, "keras": keras.__version__, "workers": size, "batch per worker": args.batch,
        "intra_op threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "parameters": int(model.count_params()),
        "optimizer": "SGD(lr=0.01*workers, momentum=0.9)", "step": "tf.function",
        "initial weights checksum": round(float(sum(np.abs(v.numpy()).sum() for v in model.weights)), 4),
        "side": side,
    }


def _measure(step, local, reduce, x, y, args: argparse.Namespace, torch_reduce=None) -> dict:  # noqa: ANN001
    """Timed blocks: ``--block`` training steps, then as many local steps and reductions.

    The rounds of blocks that hold the first ``--warmup`` training steps are not timed.
    ``torch_reduce`` (ringpipe's side): also blocks of the same reduction through the torch face,
    from the calling thread, on torch tensors of the gradients' shapes (no graph, no bridge).
    """
    n = len(x) // args.batch
    batches = [(x[k * args.batch : (k + 1) * args.batch], y[k * args.batch : (k + 1) * args.batch]) for k in range(n)]
    parts = ("step", "local", "reduce") + (("reduce_torch",) if torch_reduce is not None else ())
    times: dict[str, list[float]] = {part: [] for part in parts}
    losses: list[float] = []
    i = 0
    while len(times["step"]) < args.steps:
        timed = i >= args.warmup
        for part in parts:
            for _ in range(args.block):
                bx, by = batches[i % n]
                t = time.perf_counter()
                if part == "step":
                    loss = float(step(bx, by))
                elif part == "local":
                    local(bx, by)
                elif part == "reduce":
                    reduce()
                else:
                    torch_reduce()
                dt = time.perf_counter() - t
                if part == "step":
                    losses.append(loss)
                    i += 1
                if timed:
                    times[part].append(dt)
    return {"times": times, "losses": losses}


def _local_step(loss_fn):  # noqa: ANN001, ANN202
    import keras
    import tensorflow as tf

    model = _model()
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    opt.build(model.trainable_variables)

    @tf.function
    def local(bx, by):  # noqa: ANN001, ANN202
        with tf.GradientTape() as tape:
            loss = loss_fn(by, model(bx, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                strict=True))
        return loss

    return local


def worker_ringpipe(args: argparse.Namespace) -> None:
    _threads(args)
    import keras
    import tensorflow as tf
    import torch

    import ringpipe.tensorflow as hvd

    torch.set_num_threads(1)
    hvd.init()
    x, y = _data(hvd.rank(), hvd.size())
    model = _model()
    opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt.build(model.trainable_variables)
    config = _config("ringpipe", model, hvd.size(), args)
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(bx, by):  # noqa: ANN001, ANN202
        with tf.GradientTape() as tape:
            loss = loss_fn(by, model(bx, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    grads = [tf.ones(v.shape) for v in model.trainable_variables]
    reduce = tf.function(lambda: hvd.grouped_allreduce(grads))
    import ringpipe as hvd_torch

    torch_grads = [torch.ones(tuple(v.shape)) for v in model.trainable_variables]
    out = _measure(step, _local_step(loss_fn), reduce, x, y, args,
                   lambda: hvd_torch.grouped_allreduce_([g.clone() for g in torch_grads]))
    out["config"] = {**config, "torch threads": torch.get_num_threads(), "collective": "ringpipe engine, gloo"}
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    hvd.shutdown()


def worker_mwms(args: argparse.Namespace) -> None:
    _threads(args)
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
    config = _config("mwms", model, size, args)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    global_batch = args.batch * size

    @tf.function
    def step(bx, by):  # noqa: ANN001, ANN202
        def replica(bx, by):  # noqa: ANN001, ANN202
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(by, model(bx, training=True)), global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))  # summed over replicas
            return loss * size  # this worker's mean loss, as ringpipe's step returns it

        return strategy.run(replica, args=(bx, by))

    grads = [tf.ones(v.shape) for v in model.trainable_variables]

    @tf.function
    def reduce():  # noqa: ANN202
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", grads))

    local = _local_step(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    out = _measure(step, local, reduce, x, y, args)
    out["config"] = {**config, "collective": "MultiWorkerMirroredStrategy, gRPC RING"}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run(side: str, args: argparse.Namespace, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        wargs = ["--worker", side, "--out", out, *(f"--{k}={getattr(args, k)}" for k in
                                                  ("batch", "steps", "warmup", "block", "intra", "inter"))]
        if side == "ringpipe":
            procs.run(procs.ringpipe_cli("launch", "-n", "2", HERE, *wargs), 900, env)
        else:
            ports = _free_ports(2)
            cluster = {"worker": [f"localhost:{p}" for p in ports]}
            workers = [subprocess.Popen([sys.executable, HERE, *wargs], stdout=subprocess.DEVNULL,
                                        env=dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                                                            "task": {"type": "worker", "index": i}})))
                       for i in range(2)]
            codes = [p.wait(timeout=900) for p in workers]
            if any(codes):
                raise SystemExit(f"MultiWorkerMirroredStrategy workers exited with {codes}")
        with open(out) as f:
            return json.load(f)


def _differences(a: dict, b: dict, tol: float) -> list[str]:
    """Why the two sides did not do the same work (empty when they did)."""
    same = ("tensorflow", "keras", "workers", "batch per worker", "intra_op threads", "inter_op threads",
            "OMP_NUM_THREADS", "parameters", "optimizer", "step", "initial weights checksum")
    out = [f"{k}: {a['config'].get(k)} vs {b['config'].get(k)}" for k in same if a["config"].get(k) != b["config"].get(k)]
    worst = max((abs(p - q) / max(1.0, abs(q)) for p, q in zip(a["losses"], b["losses"], strict=False)), default=0.0)
    if worst > tol:
        out.append(f"per-step losses differ by up to {worst:.2e} (tolerance {tol:.0e})")
    return out


def _stat(xs: list[float]) -> str:
    return stats.spread(xs, "p10-p90").fmt(2, 1e3)


def main(argv: list[str] | None = None) -> int | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["ringpipe", "mwms"])
    p.add_argument("--out")
    p.add_argument("--batch", type=int, default=32, help="per-worker batch")
    p.add_argument("--steps", type=int, default=60, help="timed training steps per run")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--block", type=int, default=10, help="consecutive calls per timed block")
    p.add_argument("--intra", type=int, default=1, help="tf.config.threading intra-op threads (both sides)")
    p.add_argument("--inter", type=int, default=2, help="tf.config.threading inter-op threads (both sides)")
    p.add_argument("--repeats", type=int, default=2, help="ABBA pairs of runs")
    p.add_argument("--tol", type=float, default=1e-3, help="relative loss difference that refuses the ratio")
    p.add_argument("--quick", action="store_true", help="seconds: 2 timed steps after 1, one run of each side")
    args = p.parse_args(argv)
    if args.worker == "ringpipe":
        return worker_ringpipe(args)
    if args.worker == "mwms":
        return worker_mwms(args)
    if args.quick:
        args.steps, args.warmup, args.block, args.repeats = 2, 1, 1, 1
    report.header("tf_tape_vs_mwms", argv)
    env = dict(os.environ, **ENV)
    runs: dict[str, list[dict]] = {"ringpipe": [], "mwms": []}
    for r in range(args.repeats):
        for side in (("ringpipe", "mwms") if r % 2 == 0 else ("mwms", "ringpipe")):
            runs[side].append(_run(side, args, env))
            print(f"{side}: median step {statistics.median(runs[side][-1]['times']['step']) * 1e3:.2f} ms "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    for side in runs:
        print(f"\n{side} ran: " + json.dumps(runs[side][0]["config"]))
    print(f"\n2 workers, batch {args.batch} per worker, {args.steps} steps after {args.warmup}, blocks of "
          f"{args.block}, ABBA x{args.repeats}; ms, median [p10-p90] over every run's calls")
    print("| side | step | local (fwd+bwd+apply) | reduce only | step - local | run medians of step |")
    print("| --- | --- | --- | --- | --- | --- |")
    med = {}
    for side, label in (("ringpipe", "ringpipe DistributedGradientTape"), ("mwms", "TF MultiWorkerMirroredStrategy")):
        t = {k: [v for run in runs[side] for v in run["times"][k]] for k in ("step", "local", "reduce")}
        med[side] = [statistics.median(run["times"]["step"]) for run in runs[side]]
        gap = (statistics.median(t["step"]) - statistics.median(t["local"])) * 1e3
        print(f"| {label} | {_stat(t['step'])} | {_stat(t['local'])} | {_stat(t['reduce'])} | {gap:.2f} | "
              f"{', '.join(f'{m * 1e3:.2f}' for m in med[side])} |")
    torch_side = [v for run in runs["ringpipe"] for v in run["times"].get("reduce_torch", [])]
    if torch_side:
        print(f"\nringpipe's reduction through the torch face (grouped_allreduce_ of torch tensors of the same "
              f"shapes, from the calling thread, no graph): {_stat(torch_side)} ms")
    problems = _differences(runs["ringpipe"][0], runs["mwms"][0], args.tol)
    if problems:
        print("\nNo ratio: the sides did not do the same work: " + "; ".join(problems))
        report.footer()
        return 0
    wins = sum(a < b for a, b in zip(med["ringpipe"], med["mwms"], strict=True))
    r, m = statistics.median(med["ringpipe"]), statistics.median(med["mwms"])
    print(f"\nratio ringpipe / MWMS (median of run medians): {r / m:.2f}; ringpipe faster in {wins} of "
          f"{len(med['mwms'])} pairs; per-step losses agree within {args.tol:.0e}")
    report.headline([("DistributedGradientTape training step, Keras CNN, 2 workers",
                      "TF MultiWorkerMirroredStrategy (gRPC, RING)", stats.ratios(med["ringpipe"], med["mwms"]))])
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
