"""The consistency header: every collective's first messages say which call each rank is making.

A header is 32 int64 words (256 bytes): a magic word, the sender's rank, flags, the sender's
call ``(seq, collective, op, dtype, count, root, algorithm, detail)`` (``detail`` is a
fingerprint of everything else the ranks must agree on: the shape, the root of an object
broadcast, the members of a split, Horovod's scale factors), once some rank has seen two calls
that differ, the two ranks and their calls, and, once some rank is known to have made an
invalid call, that rank and the length of its error text, which follows the 32 words (at most
:data:`TEXT_BYTES`). Headers travel along the recursive doubling pattern (with the payload
itself for small allreduces, so the check costs no extra message), and every rank merges what
it receives: if two calls differ anywhere, every rank knows it after ``ceil(lg p)`` steps
(induction over the hypercube), and all raise the same :class:`MismatchError` instead of
hanging or returning garbage.

Why an invalid call still sends headers: a rank whose arguments are wrong (a bad root, an
unsupported dtype, a length the ranks cannot split) cannot run the collective, but if it just
raised, its peers would wait for it forever. It runs the header exchange instead, marked
invalid and carrying its error text; every rank then raises :class:`InvalidCallError` with
the text of the lowest invalid rank (the minimum is associative, so all ranks agree).
:mod:`ringpipe.comm.consistency` runs the exchange for the communicators' own collectives and
turns a disagreement into the same error on every rank.

Why headers go before payloads: gloo aborts the whole process when a message is longer than
the receive buffer and silently accepts a shorter one, so a payload receive is only posted
once every rank knows that all calls agree. Header messages are at most
:data:`EAGER_BYTES` long and are received into buffers of that size, which is safe whatever
the peer's call is.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ringpipe.comm.base import CommError, Communicator, ReduceOp

__all__ = [
    "CallInfo",
    "HeaderState",
    "InvalidCallError",
    "MismatchError",
    "COLLECTIVES",
    "ALGORITHM_CODES",
    "DTYPES",
    "EAGER_BYTES",
    "HEADER_BYTES",
    "HEADER_TAG",
    "TEXT_BYTES",
    "fingerprint",
    "invalid_message",
    "next_seq",
    "scratch",
]

HEADER_INTS = 32
HEADER_BYTES = HEADER_INTS * 8
#: The largest header-bearing message (header + inline payload) and the size of the buffers
#: that receive them. The same constant on every rank keeps every header message size-safe.
EAGER_BYTES = 1 << 20
HEADER_TAG = 7001
#: The longest error text an invalid call carries after its header (longer texts are cut).
TEXT_BYTES = 1024
_MAGIC = 0x52504844  # "RPHD"

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


def _cut(text: str) -> bytes:
    """``text`` as UTF-8, shortened to at most :data:`TEXT_BYTES` bytes."""
    raw = text.encode("utf-8")
    if len(raw) <= TEXT_BYTES:
        return raw
    return raw[:TEXT_BYTES - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."


# Header layout (int64 words): magic, sender, flags, the sender's call (8 words), the first
# mismatch known (rank, call, rank, call: 18 words), the lowest invalid rank and its text length.
_CALL = slice(3, 11)
_MISMATCH = slice(11, 29)
_INVALID = slice(29, 31)
_HAS_MISMATCH = 1
_HAS_INVALID = 2


@dataclass
class HeaderState:
    """What one rank knows during a collective: its call, the first mismatch, the first invalid call.

    ``invalid`` is the lowest rank known to have made an invalid call, with its error text.
    """

    rank: int
    call: CallInfo
    mismatch: tuple[int, CallInfo, int, CallInfo] | None = None
    invalid: tuple[int, str] | None = None

    def write(self, buf: torch.Tensor) -> int:
        """Write the header (and any error text after it) into a uint8 buffer; return its length.

        ``buf`` must hold :data:`HEADER_BYTES` bytes, plus :data:`TEXT_BYTES` once
        :attr:`invalid` is set.
        """
        words = [_MAGIC, self.rank, 0, *self.call] + [0] * (HEADER_INTS - _CALL.stop)
        if self.mismatch is not None:
            ra, ca, rb, cb = self.mismatch
            words[2] |= _HAS_MISMATCH
            words[_MISMATCH] = [ra, *ca, rb, *cb]
        text = b""
        if self.invalid is not None:
            text = _cut(self.invalid[1])
            words[2] |= _HAS_INVALID
            words[_INVALID] = [self.invalid[0], len(text)]
        if buf.device.type == "cpu":  # numpy: a tenth of the cost of a torch.tensor round trip
            buf[:HEADER_BYTES].numpy().view(np.int64)[:] = words
        else:
            buf[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
        if text:
            raw = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            buf[HEADER_BYTES:HEADER_BYTES + len(text)].copy_(raw)
        return HEADER_BYTES + len(text)

    def absorb(self, buf: torch.Tensor, peer: int) -> bool:
        """Merge a received header; return True while no mismatch and no invalid call is known."""
        head = buf[:HEADER_BYTES]
        words = (head.numpy().view(np.int64) if head.device.type == "cpu" else head.view(torch.int64)).tolist()
        if words[0] != _MAGIC or words[1] != peer:
            raise MismatchError(
                f"rank {self.rank} received a message from rank {peer} that is not a ringpipe "
                f"collective header (magic {words[0]:#x}); another message was sent on tag "
                f"{HEADER_TAG} or the peer is not running a ringpipe collective"
            )
        flags = words[2]
        theirs = CallInfo(*words[_CALL])
        if flags & _HAS_INVALID:
            bad, length = words[_INVALID]
            if self.invalid is None or bad < self.invalid[0]:
                raw = bytes(buf[HEADER_BYTES:HEADER_BYTES + min(max(length, 0), TEXT_BYTES)].tolist())
                self.invalid = (bad, raw.decode("utf-8", "replace"))
        if self.mismatch is None:
            if flags & _HAS_MISMATCH:
                m = words[_MISMATCH]
                self.mismatch = (m[0], CallInfo(*m[1:9]), m[9], CallInfo(*m[10:18]))
            elif theirs != self.call:
                self.mismatch = (self.rank, self.call, peer, theirs)
        return self.ok

    @property
    def ok(self) -> bool:
        """True while every call seen so far agrees and is valid."""
        return self.mismatch is None and self.invalid is None


@dataclass
class _CommState:
    seq: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


_STATES: weakref.WeakKeyDictionary[Communicator, _CommState] = weakref.WeakKeyDictionary()


def _state(comm: Communicator) -> _CommState:
    st = _STATES.get(comm)
    if st is None:
        st = _STATES[comm] = _CommState()
    return st


def next_seq(comm: Communicator) -> int:
    """The number of this collective on ``comm`` (1, 2, ...), the same on every rank."""
    st = _state(comm)
    st.seq += 1
    return st.seq


def scratch(comm: Communicator, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """A reusable uint8 buffer of at least ``nbytes`` (kept per communicator and name)."""
    st = _state(comm)
    key = f"{name}@{device}"
    buf = st.buffers.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=device)
        st.buffers[key] = buf
    return buf
