"""Real TensorFlow ranks and one-process references for the tests of ringpipe's TensorFlow face.

A rank script under ``tests/scripts/`` writes ``rank<R>.json`` into the folder it is given;
:func:`run_ranks` launches it on ``n`` processes (``ringpipe launch`` over gloo, or ``mpirun``
over MPI) with TensorFlow kept to one intra-op thread per rank, and reads what every rank wrote.
:class:`TFJobs` (the session fixture ``tf_jobs`` of ``tests/e2e/tensorflow``) runs the scripts of
one world size, backend and Keras in one job (``tests/scripts/tf_jobs.py``, table :data:`JOBS`),
so that each rank imports TensorFlow and torch once for all of them.
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


def _launch(argv: list[str], n: int, *, mpi: bool, env: dict[str, str] | None,
            timeout: int) -> subprocess.CompletedProcess[str]:
    """``argv`` (a Python program and its arguments) on ``n`` ranks under ``ringpipe launch`` or ``mpirun``."""
    argv = [sys.executable, *argv]
    env = dict(ENV, **(env or {}))
    if mpi:
        from ringpipe.launch import mpirun_command

        cmd, env["RINGPIPE_BACKEND"] = mpirun_command(n, argv), "mpi"
    else:
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(n), *argv[1:]]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def run_ranks(script: str, n: int, out: Path, *, mpi: bool = False, env: dict[str, str] | None = None,
              timeout: int = 840) -> list[dict]:
    """Run ``tests/scripts/<script> OUT`` on ``n`` ranks; every rank's JSON, in rank order."""
    proc = _launch([str(SCRIPTS / script), str(out)], n, mpi=mpi, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


#: The rank scripts that share one job, by (ranks, MPI, tf-keras): the scripts of ``tests/scripts``
#: that the modules of ``tests/e2e/tensorflow`` launch, folded into one launch per world size,
#: backend and Keras (each was a launch of its own before). A script's results do not depend on
#: which scripts ran before it in its job (``tests/scripts/tf_jobs.py`` starts each on a fresh state).
JOBS: dict[tuple[int, bool, bool], tuple[str, ...]] = {
    (2, False, False): ("tf_collectives", "tf_train", "tf_conformance", "tf_keras_horovod", "tf_more",
                        "tf_elastic_run"),
    (2, False, True): ("tf_conformance_legacy", "tf_keras_horovod", "tf_legacy_keras"),
    (3, False, False): ("tf_nranks", "tf_features"),
    (2, True, False): ("tf_more", "tf_elastic_run"),
    (3, True, False): ("tf_nranks",),
}
#: Seconds a job may run: under the 900 s of the test whose fixture launches it.
JOB_TIMEOUT = 880


class TFJobs:
    """Each :data:`JOBS` entry launched once, the first time a test asks for one of its scripts' results."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs: dict[tuple, tuple[Path, subprocess.CompletedProcess[str]]] = {}

    def results(self, script: str, n: int, *, mpi: bool = False, legacy: bool = False) -> list[dict]:
        """What ``tests/scripts/<script>`` wrote on each of ``n`` ranks (``legacy``: ``TF_USE_LEGACY_KERAS=1``)."""
        name = script.removesuffix(".py")
        key: tuple = (n, mpi, legacy)
        names = JOBS.get(key, ())
        if name not in names:  # a script no job lists runs alone
            key, names = (*key, name), (name,)
        if key not in self.jobs:
            out = self.root / "-".join(str(k) for k in key)
            out.mkdir(parents=True)
            env = {"TF_USE_LEGACY_KERAS": "1"} if legacy else {}
            self.jobs[key] = out, _launch([str(SCRIPTS / "tf_jobs.py"), str(out), *names], n, mpi=mpi, env=env,
                                          timeout=JOB_TIMEOUT)
        out, proc = self.jobs[key]
        files = [out / name / f"rank{r}.json" for r in range(n)]
        said = proc.stdout + proc.stderr
        # a failed job fails the script it names and those after it (they wrote nothing); a failure
        # that names no script (the job's exit) fails every script of the job
        failed = proc.returncode != 0 and (f"tf_jobs: {name} failed" in said or "tf_jobs: " not in said
                                           or not all(f.exists() for f in files))
        assert not failed, (f"{name} failed in its job ({', '.join(names)}; exit {proc.returncode}):\n"
                            + proc.stdout[-4000:] + proc.stderr[-4000:])
        return [json.loads(f.read_text()) for f in files]


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
