"""What crosses a stage boundary: any nested structure of tensors and constants, packed for the wire.

A stage may return a tensor, or any nesting of tuples, lists and string-keyed dicts whose leaves
are tensors or constants (``int``, ``float``, ``bool``, ``str``, ``None``): hidden states,
attention masks, position ids, sizes. :func:`pack` cuts such a value into a :class:`Packed`:
its tensors in order, a hashable description of the structure with the constants in place, and
for each tensor whether a gradient flows back through it (a floating-point tensor that requires
grad). The channel sends the description once per run of shapes and the tensors every
micro-batch; gradients travel back only for the tensors marked differentiable (masks and ids go
forward only). :func:`unpack` rebuilds the value on the other side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BoundaryError", "Packed", "pack", "unpack", "encode_structure", "decode_structure"]

TENSOR = "T"
CONST = "C"
TUPLE = "U"
LIST = "L"
DICT = "D"


class BoundaryError(TypeError):
    """A stage produced a value the pipeline cannot carry between stages."""


@dataclass(frozen=True)
class Packed:
    """A boundary value cut for the wire: tensors, structure (with constants), differentiable flags."""

    tensors: tuple[torch.Tensor, ...]
    structure: Any
    grads: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: int) -> torch.Tensor:
        """The ``i``-th tensor (in the order :func:`pack` found them)."""
        return self.tensors[i]

    def __iter__(self) -> Any:
        return iter(self.tensors)

    def value(self) -> Any:
        """The value rebuilt from the tensors held."""
        return unpack(self.structure, self.tensors)

    def detached(self) -> Packed:
        return Packed(tuple(t.detach() for t in self.tensors), self.structure, self.grads)


def pack(value: Any, where: str = "a stage output") -> Packed:
    """``value`` as a :class:`Packed`; :class:`BoundaryError` names the path of an unsupported leaf."""
    tensors: list[torch.Tensor] = []

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return (TENSOR, len(tensors) - 1)
        if v is None or isinstance(v, bool | int | float | str):
            return (CONST, v)
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return (TUPLE, tuple(walk(x, f"{path}[{i}]") for i, x in enumerate(v)))
        if isinstance(v, list):
            return (LIST, tuple(walk(x, f"{path}[{i}]") for i, x in enumerate(v)))
        if isinstance(v, Mapping) and type(v) is dict:
            if not all(isinstance(k, str) for k in v):
                raise BoundaryError(f"{path} is a dict with non-string keys {list(v)}; use string keys")
            return (DICT, tuple((k, walk(x, f"{path}[{k!r}]")) for k, x in v.items()))
        raise BoundaryError(
            f"{path} is a {type(v).__name__}; what crosses a stage boundary must be tensors and constants "
            "(int, float, bool, str, None) nested in tuples, lists and dicts: convert it, or keep it inside one stage"
        )

    structure = walk(value, where)
    grads = tuple(t.is_floating_point() and t.requires_grad for t in tensors)
    return Packed(tuple(tensors), structure, grads)


def unpack(structure: Any, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> Any:
    """The value that ``structure`` describes, its tensors taken from ``tensors``."""
    kind, body = structure
    if kind == TENSOR:
        return tensors[body]
    if kind == CONST:
        return body
    if kind == TUPLE:
        return tuple(unpack(s, tensors) for s in body)
    if kind == LIST:
        return [unpack(s, tensors) for s in body]
    return {k: unpack(s, tensors) for k, s in body}


def encode_structure(structure: Any) -> bytes:
    return json.dumps(structure, separators=(",", ":")).encode()


def decode_structure(data: bytes) -> Any:
    def fix(s: Any) -> Any:
        kind, body = s
        if kind in (TENSOR, CONST):
            return (kind, body)
        if kind == DICT:
            return (kind, tuple((k, fix(v)) for k, v in body))
        return (kind, tuple(fix(v) for v in body))

    return fix(json.loads(data.decode()))
