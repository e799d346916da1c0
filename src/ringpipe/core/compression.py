"""Gradient compression for the wire: none, fp16 or bf16 (Horovod's ``hvd.Compression``)."""

from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Casts a floating-point buffer to a wire dtype before a collective and back afterwards."""

    name = "none"
    wire_dtype: torch.dtype | None = None

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether a buffer of ``dtype`` is cast (only wider floating-point types are)."""
        wire = self.wire_dtype
        return (
            wire is not None
            and dtype.is_floating_point
            and dtype != wire
            and torch.finfo(dtype).bits > torch.finfo(wire).bits
        )

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """The tensor to send and the dtype to restore (Horovod's ``compress``)."""
        if self.applies_to(tensor.dtype):
            assert self.wire_dtype is not None
            return tensor.to(self.wire_dtype), tensor.dtype
        return tensor, tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class NoneCompressor(Compressor):
    """Sends tensors as they are."""


class FP16Compressor(Compressor):
    """Sends float32/float64 as float16 (halves the bytes; ~3 significant digits)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    """Sends float32/float64 as bfloat16 (float32's range, ~2 significant digits)."""

    name = "bf16"
    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors, as ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16Compressor()
    bf16: Compressor = BF16Compressor()

    @classmethod
    def parse(cls, value: Compressor | str | None) -> Compressor:
        if value is None:
            return cls.none
        if isinstance(value, Compressor):
            return value
        found = {"none": cls.none, "fp16": cls.fp16, "bf16": cls.bf16}.get(str(value).lower())
        if found is None:
            raise ValueError(f"unknown compression {value!r}; valid: none, fp16, bf16 (or Compression.<name>)")
        return found
