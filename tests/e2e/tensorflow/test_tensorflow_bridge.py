"""How TF tensors cross to torch and back (ringpipe.tensorflow.bridge): every dtype, without copies.

The reference is TensorFlow's and torch's own documented DLPack functions and NumPy values, not
the bridge's code.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from ringpipe.tensorflow import bridge  # noqa: E402

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8,
          tf.uint16, tf.bool, tf.complex64, tf.complex128]


def _sample(dtype: tf.DType) -> tf.Tensor:
    if dtype == tf.bool:
        return tf.constant([[True, False, True], [False, False, True]])
    return tf.cast(tf.reshape(tf.range(6), [2, 3]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_an_eager_tensor_crosses_to_torch_over_its_own_buffer_and_comes_back_equal(dtype: tf.DType) -> None:
    x = _sample(dtype)
    t = bridge.to_torch(x)
    # the buffer TensorFlow itself exports through DLPack: the same memory, no copy
    own = torch.utils.dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(x))
    assert t.data_ptr() == own.data_ptr()
    assert t.dtype == own.dtype and tuple(t.shape) == (2, 3)
    back = bridge.to_tf(t.clone())
    assert back.dtype == dtype and back.shape == x.shape
    want = x.numpy() if dtype != tf.bfloat16 else tf.cast(x, tf.float32).numpy()
    got = back.numpy() if dtype != tf.bfloat16 else tf.cast(back, tf.float32).numpy()
    np.testing.assert_array_equal(got, want)


def test_a_torch_result_becomes_a_tf_tensor_over_the_same_memory() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    y = bridge.to_tf(t)
    again = torch.utils.dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(y))
    assert again.data_ptr() == t.data_ptr()
    np.testing.assert_array_equal(y.numpy(), t.numpy())


def test_what_is_not_an_eager_tensor_is_converted_first() -> None:
    assert bridge.to_torch(tf.Variable([1.0, 2.0])).tolist() == [1.0, 2.0]
    assert bridge.to_torch(np.arange(3, dtype=np.int32)).tolist() == [0, 1, 2]
    assert bridge.to_torch([[1.5, 2.5]]).tolist() == [[1.5, 2.5]]
    assert tuple(bridge.to_torch(tf.zeros([0, 4])).shape) == (0, 4)
    assert tuple(bridge.to_tf(torch.zeros(0, 4)).shape) == (0, 4)
    noncontiguous = torch.arange(6.0).reshape(2, 3).t()
    np.testing.assert_array_equal(bridge.to_tf(noncontiguous).numpy(), noncontiguous.numpy())


def test_a_dtype_no_collective_takes_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="string"):
        bridge.to_torch(tf.constant(["a"]))


def test_importing_the_tensorflow_faces_and_init_leave_tensorflow_configurable() -> None:
    """A Horovod program configures TensorFlow's threads and devices after its imports and ``hvd.init()``."""
    import subprocess
    import sys

    program = (
        "import tensorflow as tf\n"
        "import ringpipe.tensorflow, ringpipe.tensorflow.keras, ringpipe.keras\n"
        "import ringpipe.tensorflow as hvd\n"
        "hvd.init()\n"  # seed 002: hvd.init(), then pin the GPU and set memory growth
        "tf.config.threading.set_intra_op_parallelism_threads(1)\n"
        "tf.config.threading.set_inter_op_parallelism_threads(2)\n"
        "tf.config.set_visible_devices(tf.config.list_physical_devices('CPU'))\n"
        "hvd.shutdown()\n"
        "print('configurable')\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "configurable" in done.stdout
