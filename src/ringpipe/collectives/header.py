"""The consistency header: every collective's first messages say which call each rank is making.

A header is 32 int64 words (256 bytes): a magic word, the sender's rank, a mismatch flag, the
sender's call ``(seq, collective, op, dtype, count, root, algorithm)`` and, once some rank has
seen two calls that differ, the two ranks and their calls. Headers travel along the recursive
doubling pattern (with the payload itself for small allreduces, so the check costs no extra
message), and every rank merges what it receives: if two calls differ anywhere, every rank
knows it after ``ceil(lg p)`` steps (induction over the hypercube), and all raise the same
:class:`MismatchError` instead of hanging or returning garbage.

Why headers go before payloads: gloo aborts the whole process when a message is longer than
the receive buffer and silently accepts a shorter one, so a payload receive is only posted
once every rank knows that all calls agree. Header messages are at most
:data:`EAGER_BYTES` long and are received into buffers of that size, which is safe whatever
the peer's call is.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ringpipe.comm.base import CommError, Communicator, ReduceOp

__all__ = [
    "CallInfo",
    "HeaderState",
    "MismatchError",
    "COLLECTIVES",
    "ALGORITHM_CODES",
    "DTYPES",
    "EAGER_BYTES",
    "HEADER_BYTES",
    "HEADER_TAG",
    "next_seq",
    "scratch",
]

HEADER_INTS = 32
HEADER_BYTES = HEADER_INTS * 8
#: The largest header-bearing message (header + inline payload) and the size of the buffers
#: that receive them. The same constant on every rank keeps every header message size-safe.
EAGER_BYTES = 1 << 20
HEADER_TAG = 7001
_MAGIC = 0x52504844  # "RPHD"

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
ALGORITHM_CODES = ("auto", "ring", "rabenseifner", "recursive_doubling", "tree", "hierarchical", "native")
_OPS = tuple(ReduceOp)
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
)  # fmt: skip
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


class MismatchError(CommError):
    """Ranks called different collectives (or the same one with different arguments)."""


class CallInfo(NamedTuple):
    """One rank's call, as integers that fit in a header."""

    seq: int
    coll: int
    op: int
    dtype: int
    numel: int
    root: int
    algo: int

    @classmethod
    def make(cls, seq: int, coll: str, op: ReduceOp | None, dtype: torch.dtype, count: int,
             root: int, algo: str) -> CallInfo:
        if dtype not in _DTYPE_CODE:
            valid = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise CommError(
                f"{coll}: dtype {dtype} is not supported by ringpipe's collectives (valid: {valid}); "
                "convert the tensor (e.g. bool -> uint8) or use algorithm='native'"
            )
        op_code = -1 if op is None else _OPS.index(op)
        return cls(seq, COLLECTIVES.index(coll), op_code, _DTYPE_CODE[dtype], count, root,
                   ALGORITHM_CODES.index(algo))

    def describe(self, other: CallInfo) -> str:
        """This call as text, naming the fields that differ from ``other``."""
        text = f"{str(DTYPES[self.dtype]).removeprefix('torch.')}[{self.numel}]"
        if self.coll != other.coll or self.seq != other.seq:
            text = f"{COLLECTIVES[self.coll]} #{self.seq} of {text}"
        if self.op != other.op:
            text += f" op={_OPS[self.op].value if self.op >= 0 else None}"
        if self.root != other.root:
            text += f" root={self.root}"
        if self.algo != other.algo:
            text += f" algorithm={ALGORITHM_CODES[self.algo]}"
        return text


def mismatch_message(rank_a: int, a: CallInfo, rank_b: int, b: CallInfo) -> str:
    if rank_a > rank_b:
        rank_a, a, rank_b, b = rank_b, b, rank_a, a
    if a.coll == b.coll and a.seq == b.seq:
        where = f"{COLLECTIVES[a.coll]} #{a.seq}"
    else:
        where = f"collective #{min(a.seq, b.seq)}"
    return (
        f"{where}: rank {rank_a} has {a.describe(b)}, rank {rank_b} has {b.describe(a)}; "
        "every rank must make the same collective calls in the same order with the same "
        "dtype, element count, op and root (this communicator cannot be used after this error)"
    )


@dataclass
class HeaderState:
    """What one rank knows during a collective: its own call and the first mismatch seen."""

    rank: int
    call: CallInfo
    mismatch: tuple[int, CallInfo, int, CallInfo] | None = None

    def write(self, buf: torch.Tensor) -> None:
        """Write the header into the first :data:`HEADER_BYTES` of a uint8 buffer."""
        words = [_MAGIC, self.rank, 0, *self.call]
        if self.mismatch is not None:
            ra, ca, rb, cb = self.mismatch
            words = [_MAGIC, self.rank, 1, *self.call, ra, *ca, rb, *cb]
        words += [0] * (HEADER_INTS - len(words))
        buf[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))

    def absorb(self, buf: torch.Tensor, peer: int) -> bool:
        """Merge a received header; return True while no mismatch is known."""
        words = buf[:HEADER_BYTES].view(torch.int64).tolist()
        if words[0] != _MAGIC or words[1] != peer:
            raise MismatchError(
                f"rank {self.rank} received a message from rank {peer} that is not a ringpipe "
                f"collective header (magic {words[0]:#x}); another message was sent on tag "
                f"{HEADER_TAG} or the peer is not running a ringpipe collective"
            )
        theirs = CallInfo(*words[3:10])
        if self.mismatch is None:
            if words[2]:
                self.mismatch = (words[10], CallInfo(*words[11:18]), words[18], CallInfo(*words[19:26]))
            elif theirs != self.call:
                self.mismatch = (self.rank, self.call, peer, theirs)
        return self.mismatch is None

    def raise_if_mismatch(self) -> None:
        if self.mismatch is not None:
            raise MismatchError(mismatch_message(*self.mismatch))


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
