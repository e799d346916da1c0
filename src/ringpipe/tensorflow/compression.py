"""``hvd.Compression`` for TensorFlow: Horovod's ``compress``/``decompress`` on TF tensors, the engine's wire.

Horovod's TensorFlow compressors (``horovod/tensorflow/compression.py``) work on TF tensors:
``compress(tensor)`` returns ``(compressed, ctx)`` and ``decompress(compressed, ctx)`` the tensor
again. ``Compression.none`` returns the tensor with ``ctx=None``; ``Compression.fp16`` casts a
floating-point tensor to ``float16`` with its own dtype as ``ctx`` and leaves any other tensor as
it is, and ``decompress`` casts back to a floating-point ``ctx``. ``Compression.bf16`` (ringpipe's)
does the same with ``bfloat16``.

The compressors are the engine's (:mod:`ringpipe.core.compression`) with those methods added
for TF tensors: a collective hands the compressor to the one engine, which decides the wire
dtype as for torch (only floating-point types wider than the wire dtype are cast), so a
``bfloat16`` tensor under ``fp16`` travels as it is rather than as ``float16``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import torch

from ringpipe.core import compression as _core

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]

Compressor = _core.Compressor


class NoneCompressor(_core.NoneCompressor):
    """Sends tensors as they are; on a TF tensor ``compress`` gives ``(tensor, None)``."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        if isinstance(tensor, torch.Tensor):
            return super().compress(tensor)
        return tensor, None

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        if isinstance(tensor, torch.Tensor):
            return super().decompress(tensor, ctx)
        return tensor


class _CastCompressor:
    """On a TF tensor: cast a floating-point tensor to ``tf_wire``; ``ctx`` is the tensor's dtype."""

    tf_wire: tf.DType

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        if isinstance(tensor, torch.Tensor):
            return super().compress(tensor)  # type: ignore[misc]
        dtype = tf.as_dtype(tensor.dtype).base_dtype
        return (tf.cast(tensor, self.tf_wire) if dtype.is_floating else tensor), dtype

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        if isinstance(tensor, torch.Tensor):
            return super().decompress(tensor, ctx)  # type: ignore[misc]
        if ctx is not None and tf.as_dtype(ctx).is_floating:
            return tf.cast(tensor, ctx)
        return tensor


class FP16Compressor(_CastCompressor, _core.FP16Compressor):
    """Sends floating-point tensors as ``float16`` (Horovod's ``Compression.fp16``)."""

    tf_wire = tf.float16


class BF16Compressor(_CastCompressor, _core.BF16Compressor):
    """Sends floating-point tensors as ``bfloat16``."""

    tf_wire = tf.bfloat16


class Compression(_core.Compression):
    """``Compression.none``, ``Compression.fp16``, ``Compression.bf16`` (also accepted by the shared collectives)."""

    none: _core.Compressor = NoneCompressor()
    fp16: _core.Compressor = FP16Compressor()
    bf16: _core.Compressor = BF16Compressor()
