"""Micro-batches of a batch: the split along dimension 0 and the runs of equal shapes the channels announce."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["split_microbatches"]


def split_microbatches(batch: Any, microbatches: int) -> list[Any]:
    """Split a tensor (or tuple of tensors) along dim 0 into ``microbatches`` chunks."""
    tensors = batch if isinstance(batch, tuple | list) else (batch,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"a batch must be a tensor or a tuple of tensors, got {type(batch).__name__}")
    size = tensors[0].shape[0] if tensors[0].dim() else 0
    if any((t.shape[0] if t.dim() else 0) != size for t in tensors):
        raise ValueError(f"batch tensors have different first dimensions {[tuple(t.shape) for t in tensors]}")
    if size < microbatches:
        raise ValueError(
            f"a batch of {size} samples cannot be split into {microbatches} micro-batches; "
            "use fewer micro-batches or a larger batch (or drop the last, smaller batch)"
        )
    parts = [torch.tensor_split(t, microbatches, dim=0) for t in tensors]
    if isinstance(batch, tuple | list):
        return [tuple(p[i] for p in parts) for i in range(microbatches)]
    return list(parts[0])


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, tuple | list) else batch
    return int(first.shape[0])


def _run_lengths(chunks: Sequence[Any]) -> list[int]:
    """For each chunk, how many chunks from it on have the same shapes (within this list)."""
    shapes = [tuple(tuple(t.shape) for t in (c if isinstance(c, tuple | list) else (c,))) for c in chunks]
    out = [1] * len(shapes)
    for i in range(len(shapes) - 2, -1, -1):
        if shapes[i] == shapes[i + 1]:
            out[i] = out[i + 1] + 1
    return out
