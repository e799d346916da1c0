"""``RingpipeStatus``: a graph collective's error leaves the graph with the error's own TensorFlow code.

Each case runs in a fresh interpreter, because the op is registered once per process, on the
first graph that needs it. One process, no peers: the bodies handed to ``bridge.run`` raise
ringpipe's cross-rank errors themselves, so the expected codes are Horovod's as written here
(ranks that disagree: ``FailedPrecondition``; an invalid call: ``InvalidArgument``), as the
error code and as the exception's TensorFlow class. The op is
also first registered from a function that AutoGraph converts (a user's ``tf.function`` calling
``bridge.run`` directly); its kernel must stay alive there too, or the graph's first run
crashes the process. Skipped without TensorFlow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

tf = pytest.importorskip("tensorflow")

SCRIPT = r"""
import json, sys
import tensorflow as tf
from ringpipe.tensorflow import bridge

x = tf.constant([1.0, 2.0, 3.0])

def doubled(v):
    return [v * 2]

def mismatched(v):
    raise bridge.MismatchedCallError("ranks 0 and 1 called different collectives")

def invalid(v):
    raise bridge.InvalidCallError("rank 1: the root rank is outside the process set")

def in_graph(fn):
    # converted by AutoGraph (no do_not_convert): a user's function calling bridge.run itself
    @tf.function
    def g(t):
        return bridge.run(fn, [t], [t.dtype], [t.shape], name="Probe")[0]
    return g

out = {"doubled": in_graph(doubled)(x).numpy().tolist(), "doubled_eager": bridge.run(doubled, [x], [x.dtype], [x.shape])[0].numpy().tolist()}
for name, fn in (("mismatched", mismatched), ("invalid", invalid)):
    for mode, call in (("graph", lambda: in_graph(fn)(x)), ("eager", lambda: bridge.run(fn, [x], [x.dtype], [x.shape]))):
        try:
            call()
            out[f"{name}_{mode}"] = None
        except tf.errors.OpError as exc:
            out[f"{name}_{mode}"] = [exc.error_code, isinstance(exc, tf.errors.FailedPreconditionError),
                                     isinstance(exc, tf.errors.InvalidArgumentError), exc.message]
from ringpipe.tensorflow import status_op
out["kernel_held"] = status_op._kernel is not None
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # a file, not ``python -c``: AutoGraph converts only functions whose source it can read
    script = tmp_path_factory.mktemp("status_op") / "case.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_a_node_first_built_in_autograph_code_runs_and_returns_its_outputs(result):
    assert result["doubled"] == [2.0, 4.0, 6.0]
    assert result["doubled_eager"] == [2.0, 4.0, 6.0]
    # the ctypes callback TensorFlow calls as the kernel is still held: a freed one crashes the
    # process at the first or a later run, depending on when its memory is reused
    assert result["kernel_held"]


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_ranks_that_disagree_fail_with_failed_precondition(result, mode):
    code, failed_precondition, invalid_argument, message = result[f"mismatched_{mode}"]
    assert code == tf.errors.FAILED_PRECONDITION and failed_precondition and not invalid_argument
    assert "ranks 0 and 1 called different collectives" in message


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_an_invalid_call_fails_with_invalid_argument(result, mode):
    code, failed_precondition, invalid_argument, message = result[f"invalid_{mode}"]
    assert code == tf.errors.INVALID_ARGUMENT and invalid_argument and not failed_precondition
    assert "the root rank is outside the process set" in message
