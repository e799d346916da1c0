"""A model's inputs and outputs as users have them: calling a model with a batch, taking logits from its output.

A batch's input ``x`` is a tensor (one positional argument), a tuple or list (positional
arguments) or a mapping (keyword arguments, as a Hugging Face tokenizer's batch). A model's
output is a tensor, a tuple (its first element is the logits, as Hugging Face models return
with ``return_dict=False``), or a mapping or dataclass with ``logits`` (Hugging Face's
``ModelOutput``). Every mode of the trainer and every pipeline calls models and reads outputs
through this module, so one user model factory runs in all of them.

The helpers that cut and move a batch (:func:`batch_size`, :func:`batch_chunk`,
:func:`batch_slice`, :func:`batch_to`) treat every tensor of ``x`` as indexed by sample along
its first dimension, as a collated batch is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelIOError",
    "call_args",
    "call_model",
    "logits_of",
    "tensors_of",
    "batch_size",
    "batch_chunk",
    "batch_slice",
    "batch_index",
    "batch_to",
]


class ModelIOError(TypeError):
    """A batch or a model output of a kind the trainer cannot use."""


def call_args(x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` to call a model with for input ``x``: tensor, tuple/list or mapping."""
    if isinstance(x, Mapping):
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise ModelIOError(f"a mapping batch is passed as keyword arguments; its keys must be strings, not {bad!r}")
        return (), dict(x)
    if isinstance(x, tuple | list):
        return tuple(x), {}
    return (x,), {}


def call_model(model: nn.Module | Any, x: Any) -> Any:
    """``model`` called with batch input ``x``: ``model(x)``, ``model(*x)`` or ``model(**x)``."""
    args, kwargs = call_args(x)
    return model(*args, **kwargs)


def logits_of(out: Any) -> Any:
    """The logits of a model output: a tensor as is, a tuple's first element, a mapping's/dataclass's ``logits``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):  # Hugging Face's ModelOutput is an OrderedDict
        if "logits" in out:
            return out["logits"]
        raise ModelIOError(
            f"the model returned a {type(out).__name__} with keys {list(out)} and no 'logits'; return a tensor, "
            "a tuple whose first element is the logits, or a mapping with 'logits'"
        )
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    if isinstance(out, tuple | list) and out:
        return out[0]
    raise ModelIOError(
        f"the model returned a {type(out).__name__}; return a tensor, a tuple whose first element is the "
        "logits, or a mapping/dataclass with 'logits' (a Hugging Face ModelOutput)"
    )


def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors of a value: a tensor, or tuples, lists and mappings (a ``ModelOutput``) of them, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in tensors_of(v)]
    if isinstance(x, tuple | list):
        return [t for v in x for t in tensors_of(v)]
    return []


def batch_size(x: Any) -> int:
    """Samples in batch input ``x`` (the first dimension of its tensors, which must agree)."""
    sizes = {int(t.shape[0]) for t in tensors_of(x) if t.dim() > 0}
    if len(sizes) != 1:
        raise ModelIOError(
            f"a batch's tensors must all hold the samples along their first dimension; found first "
            f"dimensions {sorted(sizes)}" if sizes else "a batch input holds no tensor with a batch dimension"
        )
    return sizes.pop()


def _map(x: Any, fn: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x) if x.dim() > 0 else x
    if isinstance(x, Mapping):
        return {k: _map(v, fn) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return type(x)(_map(v, fn) for v in x)
    return x


def batch_slice(x: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of batch input ``x``."""
    return _map(x, lambda t: t[start:stop])


def batch_index(x: Any, index: Any) -> Any:
    """The samples of batch input ``x`` at ``index`` (an index tensor or a slice)."""
    return _map(x, lambda t: t[index])


def batch_chunk(x: Any, chunks: int) -> list[Any]:
    """``x`` cut into at most ``chunks`` consecutive parts, as ``torch.chunk`` cuts a tensor."""
    n = batch_size(x)
    per = -(-n // max(1, chunks))
    return [batch_slice(x, i, min(n, i + per)) for i in range(0, n, per)]


def batch_to(x: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Every tensor of ``x`` moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=non_blocking)
    if isinstance(x, Mapping):
        return {k: batch_to(v, device, non_blocking) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return type(x)(batch_to(v, device, non_blocking) for v in x)
    return x
