"""Real TensorFlow ranks and one-process references for the tests of ringpipe's TensorFlow face.

A rank script under ``tests/scripts/`` writes ``rank<R>.json`` into the folder it is given;
:func:`run_ranks` launches it on ``n`` processes (``ringpipe launch`` over gloo, or ``mpirun``
over MPI) with TensorFlow kept to one intra-op thread per rank, and reads what every rank wrote.
The references are written out plainly (no ringpipe): the mean squared error's gradient of the
scripts' two-layer model, Keras's SGD update and Horovod's warmup rate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).parent / "scripts"
#: What every rank runs with: quiet logs, one intra-op thread, the scripts' folder importable.
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
           TF_NUM_INTEROP_THREADS="2", PYTHONPATH=str(SCRIPTS.parent))
HAVE_MPI = shutil.which("mpirun") is not None and find_spec("mpi4py") is not None


def run_ranks(script: str, n: int, out: Path, *, mpi: bool = False, env: dict[str, str] | None = None,
              timeout: int = 840) -> list[dict]:
    """Run ``tests/scripts/<script> OUT`` on ``n`` ranks; every rank's JSON, in rank order."""
    argv = [sys.executable, str(SCRIPTS / script), str(out)]
    env = dict(ENV, **(env or {}))
    if mpi:
        from ringpipe.launch import mpirun_command

        cmd, env["RINGPIPE_BACKEND"] = mpirun_command(n, argv), "mpi"
    else:
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(n), *argv[1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def mse_grad(weights, x, y):
    """The mean squared error's gradient of ``tanh(x @ W0 + b0) @ W1 + b1`` on one global batch, plain TensorFlow."""
    import tensorflow as tf

    ws = [tf.Variable(w) for w in weights]
    with tf.GradientTape() as tape:
        h = tf.tanh(x.astype("float64") @ ws[0] + ws[1])
        loss = tf.reduce_mean(tf.square(h @ ws[2] + ws[3] - y.astype("float64")))
    return [g.numpy() for g in tape.gradient(loss, ws)]


def keras_sgd(weights, moments, grads, lr, momentum):
    """Keras's SGD with momentum (Keras 3 and both Keras 2 kinds): m = momentum * m - lr * g; w = w + m."""
    moments = [momentum * m - lr * g for m, g in zip(moments, grads, strict=True)]
    return [w + m for w, m in zip(weights, moments, strict=True)], moments


def horovod_warmup_lr(initial_lr, epoch, batch, steps, warmup_epochs, size):
    """Horovod's LearningRateWarmupCallback for a batch: lr / size * (e * (size - 1) / warmup + 1)."""
    e = epoch + batch / steps + 1.0 / steps
    return initial_lr / size * (e * (size - 1) / warmup_epochs + 1)


def assert_close(got, want):
    """Every array of ``got`` equals its reference in ``want`` within float32 training tolerance."""
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(g), w, rtol=2e-4, atol=2e-5)
