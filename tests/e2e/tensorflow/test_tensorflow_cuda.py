"""TensorFlow GPU tensors on ringpipe's NCCL path: they cross to torch CUDA tensors and back without a host copy.

Skipped without a CUDA GPU that both torch and a GPU build of TensorFlow see (``tensorflow-cpu``
has no GPU devices). The expected values are the sums written out here.
"""

from __future__ import annotations

import pytest
import torch

from ringpipe.launch import spawn

tf = pytest.importorskip("tensorflow")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not tf.config.list_physical_devices("GPU"),
                       reason="needs a CUDA GPU seen by torch and by a GPU build of TensorFlow"),
]


def _gpu_tensors_through_nccl(comm):  # noqa: ANN001
    import ringpipe.tensorflow as hvd
    from ringpipe.tensorflow.bridge import to_tf, to_torch

    hvd.init(comm)
    try:
        with tf.device("/GPU:0"):
            x = tf.range(6, dtype=tf.float32) + 1.0
        as_torch = to_torch(x)
        back = to_tf(as_torch)
        reduced = hvd.allreduce(x, op=hvd.Sum)
        gathered = hvd.allgather(tf.reshape(x, [2, 3]))

        @tf.function
        def in_graph(v):
            return hvd.allreduce(v, op=hvd.Sum)

        with tf.device("/GPU:0"):
            graph = in_graph(x)
        return {
            "torch device": as_torch.device.type,
            "back on": back.device,
            "reduced on": reduced.device,
            "reduced": reduced.numpy().tolist(),
            "gathered": gathered.numpy().tolist(),
            "graph": graph.numpy().tolist(),
        }
    finally:
        hvd.shutdown()


def test_a_tf_gpu_tensor_is_reduced_on_the_gpu_over_nccl():
    (out,) = spawn(_gpu_tensors_through_nccl, 1, backend="nccl")
    assert out["torch device"] == "cuda"  # DLPack handed torch the GPU buffer, no host copy
    assert "GPU" in out["back on"] and "GPU" in out["reduced on"], out
    assert out["reduced"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # one rank: the sum is the tensor itself
    assert out["gathered"] == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert out["graph"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
