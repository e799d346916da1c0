"""The one description of a call that ranks compare: which collective, op, dtype, count, root, fingerprint.

Every cross-rank check describes a call the same way before it travels: the collective, the
reduce op, the dtype, the element count, the root, and a fingerprint of everything else the
ranks must agree on (the shape, the process set, Horovod's scale factors, the members of a
split). :class:`CallInfo` is that description as integers, the words of the doubling exchange's
header (:mod:`ringpipe.check.doubling_exchange`); :func:`announced_fields` is the same
description as named fields, whose fingerprint rides in an announcement
(:mod:`ringpipe.check.announcement_header`). When ranks disagree, both transports gather every
rank's fields and raise the same :class:`MismatchError` on every rank, worded by
:func:`disagreement` (or :func:`mismatch_message`); a call whose own arguments are wrong is
reported by :func:`invalid_message` as an :class:`InvalidCallError`.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch

from ringpipe.comm.base import CommError, ReduceOp

__all__ = [
    "ALGORITHM_CODES",
    "COLLECTIVES",
    "DTYPES",
    "CallInfo",
    "InvalidCallError",
    "MismatchError",
    "announced_fields",
    "describe_calls",
    "disagreement",
    "dtype_name",
    "fingerprint",
    "invalid_message",
    "mismatch_message",
    "shown_fields",
]

#: Every collective a header can name (ringpipe's algorithms run the first five).
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "barrier",
               "broadcast_object", "allgather_object", "split")
ALGORITHM_CODES = ("auto", "ring", "rabenseifner", "recursive_doubling", "tree", "hierarchical", "native")
_OPS = tuple(ReduceOp)
#: The dtypes ringpipe's own algorithms reduce and move.
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
)  # fmt: skip
#: Further dtypes a header can name (the backends' native collectives may carry them).
_MORE_DTYPES = (torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
                torch.float8_e4m3fn, torch.float8_e5m2)
_ALL_DTYPES = DTYPES + _MORE_DTYPES
_DTYPE_CODE = {d: i for i, d in enumerate(_ALL_DTYPES)}


class MismatchError(CommError):
    """Ranks called different collectives (or the same one with different arguments); raised on every rank."""


class InvalidCallError(MismatchError, ValueError):
    """Some rank called a collective with arguments it cannot run; raised on every rank.

    Also a :class:`ValueError`, as Horovod raises for invalid arguments (splits that do not add
    up, a length not divisible by the size...).
    """


def fingerprint(value: object) -> int:
    """A 62-bit digest of ``repr(value)``, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(value).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def dtype_name(dtype: torch.dtype | None) -> str:
    return "?" if dtype is None else str(dtype).removeprefix("torch.")


class CallInfo(NamedTuple):
    """One rank's call, as integers that fit in a header (-1 where a refused call has none)."""

    seq: int
    coll: int
    op: int
    dtype: int
    numel: int
    root: int
    algo: int
    detail: int = 0

    @classmethod
    def make(cls, seq: int, coll: str, op: ReduceOp | None, dtype: torch.dtype | None, count: int,
             root: int, algo: str, detail: object = None) -> CallInfo:
        """A call as header words; ``detail``: whatever else must agree (compared by fingerprint)."""
        op_code = -1 if op is None else _OPS.index(op)
        dtype_code = -1 if dtype is None else _DTYPE_CODE.get(dtype, len(_ALL_DTYPES))
        extra = 0 if detail is None else fingerprint(detail)
        if dtype is not None and dtype not in _DTYPE_CODE:
            extra = fingerprint((detail, str(dtype)))
        return cls(seq, COLLECTIVES.index(coll), op_code, dtype_code, count, root,
                   ALGORITHM_CODES.index(algo), extra)

    @classmethod
    def invalid(cls, seq: int, coll: str) -> CallInfo:
        """The call of a rank whose arguments were refused: only its number and collective."""
        return cls(seq, COLLECTIVES.index(coll), -1, -1, -1, -1, -1, -1)

    def describe(self, other: CallInfo) -> str:
        """This call as text, naming the fields that differ from ``other``."""
        dtype = dtype_name(_ALL_DTYPES[self.dtype]) if 0 <= self.dtype < len(_ALL_DTYPES) else "?"
        text = f"{dtype}[{self.numel}]"
        if self.coll != other.coll or self.seq != other.seq:
            text = f"{COLLECTIVES[self.coll]} #{self.seq} of {text}"
        if self.op != other.op:
            text += f" op={_OPS[self.op].value if self.op >= 0 else None}"
        if self.root != other.root:
            text += f" root={self.root}"
        if self.algo != other.algo:
            text += f" algorithm={ALGORITHM_CODES[self.algo] if self.algo >= 0 else '?'}"
        return text


def mismatch_message(rank_a: int, a: CallInfo, rank_b: int, b: CallInfo) -> str:
    """Two ranks' differing calls as the first sentence of a :class:`MismatchError`."""
    if rank_a > rank_b:
        rank_a, a, rank_b, b = rank_b, b, rank_a, a
    if a.coll == b.coll and a.seq == b.seq:
        where = f"{COLLECTIVES[a.coll]} #{a.seq}"
    else:
        where = f"collective #{min(a.seq, b.seq)}"
    return (
        f"{where}: rank {rank_a} has {a.describe(b)}, rank {rank_b} has {b.describe(a)}; "
        "every rank must make the same collective calls in the same order with the same "
        "dtype, shape, op and root"
    )


def invalid_message(rank: int, coll: str, seq: int, problem: str) -> str:
    """The text every rank raises when ``rank``'s call of ``coll`` was refused for ``problem``."""
    return (
        f"{coll} #{seq}: rank {rank} made an invalid call: {problem} "
        "(raised on every rank; no tensor was modified)"
    )


def announced_fields(op: str, tensor: torch.Tensor | None, reduce_op: ReduceOp | None,
                     detail: dict[str, Any] | None) -> dict[str, Any]:
    """What the ranks with data must agree on, as shown in an error (Horovod's argument names)."""
    fields: dict[str, Any] = {"collective": op}
    if tensor is not None:
        fields["dtype"] = str(tensor.dtype).removeprefix("torch.")
        # an allgather's first dimension may differ between ranks (Horovod gathers them all)
        fields["shape"] = ["*", *tensor.shape[1:]] if op == "allgather" and tensor.dim() else list(tensor.shape)
        fields["device"] = tensor.device.type
    if reduce_op is not None:
        fields["op"] = reduce_op.value
    fields.update(detail or {})
    return fields


def shown_fields(coll: str, seq: int, fields: dict[str, Any]) -> dict[str, Any]:
    """A communicator call's fields as every rank's error lists them (dtypes and ops by name)."""
    desc: dict[str, Any] = {"collective": coll, "seq": seq}
    for k, v in fields.items():
        if isinstance(v, torch.dtype):
            v = str(v).removeprefix("torch.")
        elif hasattr(v, "value") and not isinstance(v, (int, float)):
            v = v.value
        desc[k] = v
    return desc


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def describe_calls(desc: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    """One rank's call as text: ``collective(field=value, ...)``; only differing fields if ``other``."""
    fields = [(k, v) for k, v in desc.items() if k not in ("collective", "seq")]
    if other is not None:
        fields = [(k, v) for k, v in fields if other.get(k) != v]
    inner = ", ".join(f"{k}={_show(v)}" for k, v in fields)
    return f"{desc.get('collective', '?')}({inner})"


#: How Horovod names each argument when ranks disagree on it ("Mismatched data types: ...").
_MISMATCHED = {
    "collective": "operations",
    "dtype": "data types",
    "shape": "tensor shapes",
    "op": "reduce operations",
    "root": "root ranks",
    "root_rank": "root ranks",
    "prescale_factor": "prescale and/or postscale factors",
    "postscale_factor": "prescale and/or postscale factors",
    "device": "CPU/GPU device selection",
    "process_set": "process sets",
}


def disagreement(where: str, calls: list[tuple[int, dict[str, Any]]], seq: int | None = None) -> str:
    """The text every rank raises when ranks with data passed different arguments (the same on all).

    ``calls``: (rank, fields) of every rank that made a call, lowest rank first.
    """
    r0, f0 = calls[0]
    r1, f1 = next(((r, f) for r, f in calls[1:] if f != f0), calls[0])
    keys = [k for k in dict.fromkeys([*f0, *f1]) if f0.get(k) != f1.get(k)] or ["collective"]
    what = _MISMATCHED.get(keys[0], keys[0])
    coll = f0.get("collective", "?") if f0.get("collective") == f1.get("collective") else "collective"
    number = f" #{seq}" if seq is not None else ""
    shown = ", ".join(f"{k}={_show(f0.get(k))}" for k in keys)
    other = ", ".join(f"{k}={_show(f1.get(k))}" for k in keys)
    listing = "; ".join(f"rank {r}: {describe_calls(f)}" for r, f in calls)
    return (
        f"Mismatched {what} in {coll}{number} on {where}: rank {r0} passed {shown}, but rank {r1} passed "
        f"{other}. Calls: {listing}. Every rank must make the same collective calls in the same order with "
        "the same arguments; no tensor was modified and the ranks can go on"
    )
