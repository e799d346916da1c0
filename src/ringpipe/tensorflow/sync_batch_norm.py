"""``SyncBatchNormalization``: Keras batch normalisation whose training statistics cover every rank's batch.

Horovod's ``horovod.tensorflow.SyncBatchNormalization``: a subclass of the Keras
``BatchNormalization`` that ``tf.keras`` is (Keras 3, or tf-keras with ``TF_USE_LEGACY_KERAS=1``)
whose training-mode moments are those of the global batch. Each rank sums its inputs, their
squares and its count per channel; one Sum :func:`.mpi_ops.allreduce` of the three (one message)
gives the global mean and variance, and the gradients flow back through that allreduce (its
gradient is the Sum allreduce of the output gradient, Horovod's definition), so the layer's
output, moving statistics and gradients are those of one process normalising the concatenated
batch. Horovod averages the ranks' means instead, which is the same for equal local batches;
counting makes ranks with different batch sizes exact too. Inference uses the moving statistics
and communicates nothing.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ringpipe.comm.base import ReduceOp
from ringpipe.core.basics import size

from .mpi_ops import allreduce

__all__ = ["SyncBatchNormalization"]

_BatchNormalization: Any = tf.keras.layers.BatchNormalization
_KERAS2 = _BatchNormalization.__module__.startswith("tf_keras")


def global_moments(inputs: tf.Tensor, axes: list[int], weights: tf.Tensor | None = None,
                   keepdims: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
    """The mean and (biased) variance over ``axes`` of every rank's ``inputs`` (``weights``: a mask).

    Differentiable: the reduction is a Sum allreduce of ``[sum, sum of squares, count]``.
    """
    w = tf.ones_like(inputs) if weights is None else tf.cast(weights, inputs.dtype)
    local = tf.stack([tf.reduce_sum(w * inputs, axes, keepdims=keepdims),
                      tf.reduce_sum(w * tf.square(inputs), axes, keepdims=keepdims),
                      tf.reduce_sum(w, axes, keepdims=keepdims)])
    total = allreduce(local, op=ReduceOp.SUM, name="RingpipeSyncBatchNormMoments") if size() > 1 else local
    count = tf.maximum(total[2], tf.ones_like(total[2]))
    mean = total[0] / count
    variance = tf.maximum(total[1] / count - tf.square(mean), tf.zeros_like(mean))
    return mean, variance


def _moments_keras2(self: Any, inputs: tf.Tensor, reduction_axes: Any, keep_dims: bool, mask: Any = None) -> Any:
    return global_moments(inputs, list(reduction_axes), _mask_weights(inputs, mask), keepdims=keep_dims)


def _moments_keras3(self: Any, inputs: tf.Tensor, mask: Any) -> Any:
    return global_moments(inputs, list(self._reduction_axes), _mask_weights(inputs, mask))


class SyncBatchNormalization(_BatchNormalization):
    """Synchronous batch normalization: statistics are synchronised across all ranks during training.

    Takes the arguments of ``tf.keras.layers.BatchNormalization``; ``fused=True`` is refused,
    as in Horovod (the fused kernel computes its moments itself).
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        if _KERAS2:
            kwargs["fused"] = False
        super().__init__(**kwargs)

    def get_config(self) -> dict[str, Any]:
        config = dict(super().get_config())
        config.pop("fused", None)
        return config

    # Keras 2 and Keras 3 call their moments hook with different arguments
    _moments = _moments_keras2 if _KERAS2 else _moments_keras3


def _mask_weights(inputs: tf.Tensor, mask: Any) -> tf.Tensor | None:
    """A mask over all but the channel axis, broadcast to the inputs (Keras's masked moments)."""
    if mask is None:
        return None
    return tf.broadcast_to(tf.expand_dims(tf.cast(mask, inputs.dtype), -1), tf.shape(inputs))
