"""The user's own data in the trainer: map-style torch Datasets as the splits the loop reads.

The loop asks a split for ``len()`` and ``batch(idx)``: a ``TensorDataset`` of (inputs, targets)
is used as tensors directly; any other map-style dataset (``__len__`` and ``__getitem__``
returning an ``(input, target)`` pair) is read item by item for each batch and stacked with
``torch.utils.data.default_collate``, so it need not fit in memory. Every rank reads the items of
its own shard only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ringpipe.pipeline.model_io import batch_slice
from ringpipe.train.datasets import Dataset, Split

__all__ = ["TorchSplit", "as_split", "as_dataset", "is_one_split", "DataError"]


class DataError(TypeError):
    """The user's data is not a map-style dataset of (input, target) pairs; the message says what it is."""


class TorchSplit:
    """A map-style torch Dataset read batch by batch (items are ``(input, target)`` pairs)."""

    def __init__(self, dataset: Any, what: str) -> None:
        self.dataset, self.what = dataset, what

    def __len__(self) -> int:
        return len(self.dataset)

    def item(self, i: int) -> tuple[Any, Any]:
        item = self.dataset[i]
        if not isinstance(item, tuple | list) or len(item) != 2:
            kind = f"a {len(item)}-item {type(item).__name__}" if isinstance(item, tuple | list) else type(item).__name__
            raise DataError(
                f"{self.what}[{i}] is {kind}; each item must be a pair (input, target), as torchvision's "
                f"datasets and TensorDataset(x, y) give"
            )
        return item[0], item[1]

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate

        xs, ys = zip(*(self.item(int(i)) for i in idx), strict=True)
        x, y = default_collate(list(xs)), default_collate(list(ys))
        if not _is_input(x) or not isinstance(y, torch.Tensor):
            raise DataError(
                f"{self.what}: a batch of inputs collates to {type(x).__name__} and of targets to "
                f"{type(y).__name__}; the trainer needs inputs that collate to a tensor, a tuple of tensors "
                "(positional arguments) or a mapping of tensors (keyword arguments), and tensor targets"
            )
        return x, y


def _is_input(x: Any) -> bool:
    """Whether collated inputs are what a model is called with (see :mod:`ringpipe.pipeline.model_io`)."""
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, Mapping):
        return bool(x) and all(isinstance(v, torch.Tensor) for v in x.values())
    return isinstance(x, tuple | list) and bool(x) and all(isinstance(v, torch.Tensor) for v in x)


def _check_map_style(data: Any, what: str) -> None:
    if isinstance(data, torch.utils.data.IterableDataset) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise DataError(
            f"{what} is a {type(data).__name__}; the trainer needs a map-style dataset (__len__ and __getitem__ "
            f"returning (input, target)), e.g. torch.utils.data.TensorDataset(x, y): it shards the indices "
            f"over the replicas itself"
        )
    if len(data) == 0:
        raise DataError(f"{what} is empty")


def as_split(data: Any, what: str) -> Split | TorchSplit:
    """A split the loop can read from ``data`` (a TensorDataset of two tensors is used as tensors)."""
    if isinstance(data, Split | TorchSplit):
        return data
    _check_map_style(data, what)
    tensors = getattr(data, "tensors", None)
    if isinstance(data, torch.utils.data.TensorDataset) and tensors is not None and len(tensors) == 2:
        return Split(tensors[0], tensors[1])
    return TorchSplit(data, what)


def _num_classes(split: Split | TorchSplit) -> int:
    """Classes of integer scalar targets held as a tensor (0 when not known without reading every item)."""
    y = split.y if isinstance(split, Split) else None
    if isinstance(split, TorchSplit):
        targets = getattr(split.dataset, "targets", None)  # torchvision's datasets keep their labels
        y = torch.as_tensor(targets) if targets is not None else None
    if y is None or y.dim() != 1 or y.dtype.is_floating_point or y.dtype == torch.bool or len(y) == 0:
        return 0
    return int(y.max()) + 1


def _empty_like(split: Split | TorchSplit) -> Split:
    x, y = split.batch(torch.arange(1))
    return Split(batch_slice(x, 0, 0), y[:0])


def is_one_split(obj: Any) -> bool:
    """Whether ``obj`` is one set of samples, not a :class:`Dataset`, ``(train, test)`` or ``{"train", ...}``."""
    if isinstance(obj, Dataset | Mapping):
        return False
    return not (isinstance(obj, tuple | list) and len(obj) == 2 and not isinstance(obj[0], torch.Tensor))


def as_dataset(obj: Any, name: str, what: str, test: Any = None, test_what: str | None = None) -> Dataset:
    """A :class:`Dataset` from the user's data: a Dataset, ``(train, test)``, ``{"train", "test"}`` or one train set.

    A missing test set evaluates nothing (test loss and accuracy are NaN; the trainer says so);
    a given test set that is empty is an error, as is an empty train set.
    """
    if isinstance(obj, Dataset):
        return obj
    if isinstance(obj, Mapping):
        if "train" not in obj:
            raise DataError(f"{what} returned a mapping without 'train' (keys: {', '.join(map(str, obj))})")
        obj, test = obj["train"], obj.get("test")
    elif not is_one_split(obj):
        obj, test = obj
    train = as_split(obj, f"{what} train set")
    test_split = as_split(test, test_what or f"{what} test set") if test is not None else _empty_like(train)
    x, y = train.batch(torch.arange(1))
    first = x if isinstance(x, torch.Tensor) else next(iter(x.values() if isinstance(x, Mapping) else x))
    kind = "lm" if y.dim() == 2 and not y.dtype.is_floating_point and first.shape[:2] == y.shape[:2] else "classification"
    return Dataset(name, train, test_split, _num_classes(train), tuple(first.shape[1:]), kind=kind)
