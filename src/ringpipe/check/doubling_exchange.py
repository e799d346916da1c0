"""The doubling exchange: ranks agree on each communicator call before any data moves, by headers along the doubling pattern.

Why: a backend's own collectives trust their callers. Over gloo, ranks passing different
lengths abort the process (``op.preamble.length <= op.nbytes``), different ops or same-sized
shapes return wrong numbers silently, and an allreduce facing an allgather hangs; MPI behaves
alike. So before a communicator runs a collective, every rank sends a 256-byte header naming
its call (collective, number, dtype, element count, op, root and a fingerprint of the shape
and other arguments: :class:`~ringpipe.check.call.CallInfo`) along the recursive doubling pattern. After
``ceil(lg p)`` steps every rank knows whether all calls agree; only then is the payload sent.

On disagreement (and only then) every rank gathers every rank's full description through the
backend's object allgather, so all raise the same :class:`MismatchError` listing every rank's
call. A rank whose own arguments are invalid takes part in the exchange marked invalid, and
every rank raises its :class:`InvalidCallError`. No tensor has been touched and every message
of the exchange has arrived, so the communicator stays usable.

The check costs one header message per doubling step. Paths that agreed on their calls
another way (the data-parallel engine announces each collective; the DistributedOptimizer's
buckets were compared once at construction) run their collectives inside
:meth:`Communicator.unchecked`; ``RINGPIPE_CHECK_CALLS=0`` turns the check off for a process
and ``comm.check_calls = False`` for one communicator.

The header is 32 int64 words (256 bytes): a magic word, the sender's rank, flags, the sender's
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
:func:`check_call` runs the exchange for the communicators' own collectives and turns a
disagreement into the same error on every rank; ringpipe's own algorithms carry the same
headers in their first messages (:mod:`ringpipe.collectives`).

Why headers go before payloads: gloo aborts the whole process when a message is longer than
the receive buffer and silently accepts a shorter one, so a payload receive is only posted
once every rank knows that all calls agree. Header messages are at most
:data:`EAGER_BYTES` long and are received into buffers of that size, which is safe whatever
the peer's call is.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ringpipe.check.call import (
    COLLECTIVES,
    CallInfo,
    InvalidCallError,
    MismatchError,
    describe_calls,
    invalid_message,
    mismatch_message,
    shown_fields,
)
from ringpipe.comm.doubling import doubling_steps

if TYPE_CHECKING:
    from ringpipe.comm.base import Communicator

__all__ = [
    "EAGER_BYTES",
    "HEADER_BYTES",
    "HEADER_TAG",
    "TEXT_BYTES",
    "HeaderState",
    "check_call",
    "checks_enabled",
    "exchange_headers",
    "home_device",
    "next_seq",
    "scratch",
    "settle",
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


def checks_enabled() -> bool:
    """The process default: on unless ``RINGPIPE_CHECK_CALLS`` is 0, false, no or off."""
    return os.environ.get("RINGPIPE_CHECK_CALLS", "1").strip().lower() not in ("0", "false", "no", "off")


def home_device(comm: Communicator) -> torch.device:
    """Where ``comm`` takes tensors: its pinned device (CUDA under NCCL), else the CPU."""
    device = getattr(comm, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def _disagreement(comm: Communicator, hs: HeaderState, calls: list[tuple[CallInfo, dict[str, Any]]]) -> str:
    """The same text on every rank: the first two ranks whose calls differ, then every rank's call."""
    first_call, first_desc = calls[0]
    other = next((r for r, (c, _) in enumerate(calls) if c != first_call), None)
    if other is None:  # the headers differed although the gathered calls agree: name the header's pair
        head = mismatch_message(*hs.mismatch) if hs.mismatch is not None else "calls differ"
    else:
        head = mismatch_message(0, first_call, other, calls[other][0])
        shown = {k for k in first_desc if first_desc.get(k) != calls[other][1].get(k)} - {"seq"}
        if shown - {"collective", "dtype", "op", "root", "algorithm"}:
            head += " (they differ in " + ", ".join(sorted(shown)) + ")"
    listing = "; ".join(f"rank {r}: {describe_calls(d)}" for r, (_, d) in enumerate(calls))
    return (
        f"{head}. Calls on {comm.name}: {listing}. No tensor was modified and {comm.name} can still "
        "be used; make every rank call the same collectives in the same order with the same arguments"
    )


def settle(comm: Communicator, hs: HeaderState, desc: dict[str, Any]) -> None:
    """After a header exchange: raise the same error on every rank if any call was invalid or differed.

    Every rank reaches the same verdict (the exchange spreads any mismatch and the lowest
    invalid rank to all), so either none or all of them take part in the gather here.
    """
    if hs.invalid is not None:
        raise InvalidCallError(hs.invalid[1])
    if hs.mismatch is None:
        return
    gathered = comm._allgather_object((tuple(hs.call), desc))
    calls = [(CallInfo(*c), d) for c, d in gathered]
    raise MismatchError(_disagreement(comm, hs, calls))


def _message(comm: Communicator, hs: HeaderState) -> torch.Tensor:
    send = scratch(comm, "hdr_send", HEADER_BYTES + TEXT_BYTES, home_device(comm))
    return send[: hs.write(send)]


def exchange_headers(comm: Communicator, call: CallInfo, desc: dict[str, Any], invalid: str | None = None,
                     algorithm: str = "native") -> None:
    """Header-only recursive doubling of ``call``; raises on every rank if calls differ or one is invalid.

    ``invalid``: the error text of a call this rank cannot run; it still takes part here so that
    no peer waits for it forever.
    """
    hs = HeaderState(comm.rank, call)
    if invalid is not None:
        hs.invalid = (comm.rank, invalid)
    recv = scratch(comm, "hdr_recv", EAGER_BYTES, home_device(comm))[:EAGER_BYTES]
    t0 = time.perf_counter_ns()
    for kind, peer, _ in doubling_steps(comm.rank, comm.size):
        if kind in ("send", "send_result"):
            comm._isend(_message(comm, hs), peer, HEADER_TAG).wait()
        elif kind in ("recv", "recv_result"):
            comm._irecv(recv, peer, HEADER_TAG).wait()
            hs.absorb(recv, peer)
        else:
            s = comm._isend(_message(comm, hs), peer, HEADER_TAG)
            comm._irecv(recv, peer, HEADER_TAG).wait()
            s.wait()
            hs.absorb(recv, peer)
    coll = COLLECTIVES[call.coll]
    comm.log.record(f"{coll}.header", HEADER_BYTES, -1, t0, time.perf_counter_ns(), HEADER_TAG,
                    comm.name, collective=coll, cid=call.seq, algorithm=algorithm)
    settle(comm, hs, desc)


def check_call(
    comm: Communicator,
    coll: str,
    fields: dict[str, Any] | None,
    problem: BaseException | None,
) -> int:
    """Agree on one call of ``coll`` with every rank of ``comm``; return its number.

    ``fields``: what must agree — ``dtype``, ``numel``, ``op``, ``root`` map to header words,
    everything else (``shape``...) goes into the fingerprint; ``None`` with ``problem``, the
    error that made this rank's call invalid.
    """
    seq = next_seq(comm)
    if problem is not None or fields is None:
        text = invalid_message(comm.rank, coll, seq, str(problem))
        call = CallInfo.invalid(seq, coll)
        desc: dict[str, Any] = {"collective": coll, "seq": seq, "invalid": str(problem)}
    else:
        op = fields.get("op")
        dtype = fields.get("dtype")
        rest = {k: v for k, v in fields.items() if k not in ("op", "dtype", "numel", "root")}
        call = CallInfo.make(seq, coll, op, dtype, int(fields.get("numel", -1)), int(fields.get("root", -1)),
                             "native", tuple(sorted(rest.items())) if rest else None)
        desc = shown_fields(coll, seq, fields)
        text = None
    try:
        exchange_headers(comm, call, desc, text)
    except InvalidCallError as exc:
        raise exc.with_traceback(None) from problem
    return seq
