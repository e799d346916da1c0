"""Micro-batches of a batch: the split along dimension 0 and the runs of equal shapes the channels announce."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ringpipe.pipeline.model_io import batch_slice

__all__ = ["split_microbatches"]


def split_microbatches(batch: Any, microbatches: int) -> list[Any]:
    """Split a batch along dim 0 into ``microbatches`` chunks (sizes as ``torch.tensor_split``).

    ``batch``: a tensor, a tuple/list of tensors or a mapping of tensors (a Hugging Face batch),
    every tensor holding the samples along its first dimension.
    """
    leaves = _tensors(batch)
    if not leaves or not _is_batch(batch):
        raise TypeError(
            f"a batch must be a tensor, a tuple of tensors or a mapping of tensors, got {type(batch).__name__}"
        )
    size = leaves[0].shape[0] if leaves[0].dim() else 0
    if any((t.shape[0] if t.dim() else 0) != size for t in leaves):
        raise ValueError(f"batch tensors have different first dimensions {[tuple(t.shape) for t in leaves]}")
    if size < microbatches:
        raise ValueError(
            f"a batch of {size} samples cannot be split into {microbatches} micro-batches; "
            "use fewer micro-batches or a larger batch (or drop the last, smaller batch)"
        )
    per, extra = divmod(size, microbatches)
    bounds = [i * per + min(i, extra) for i in range(microbatches + 1)]
    return [batch_slice(batch, bounds[i], bounds[i + 1]) for i in range(microbatches)]


def _is_batch(batch: Any) -> bool:
    if isinstance(batch, torch.Tensor):
        return True
    values = list(batch.values()) if isinstance(batch, Mapping) else batch if isinstance(batch, tuple | list) else None
    return values is not None and all(isinstance(v, torch.Tensor) for v in values)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [v for v in batch.values() if isinstance(v, torch.Tensor)]
    if isinstance(batch, tuple | list):
        return [v for v in batch if isinstance(v, torch.Tensor)]
    return []


def _batch_size(batch: Any) -> int:
    return int(_tensors(batch)[0].shape[0])


def _run_lengths(chunks: Sequence[Any]) -> list[int]:
    """For each chunk, how many chunks from it on have the same shapes (within this list)."""
    shapes = [tuple(tuple(t.shape) for t in _tensors(c)) for c in chunks]
    out = [1] * len(shapes)
    for i in range(len(shapes) - 2, -1, -1):
        if shapes[i] == shapes[i + 1]:
            out[i] = out[i + 1] + 1
    return out
