"""The cross-rank check of every collective call: ranks agree on the call before any data moves.

Why: a backend's own collectives trust their callers. Over gloo, ranks passing different
lengths abort the process (``op.preamble.length <= op.nbytes``), different ops or same-sized
shapes return wrong numbers silently, and an allreduce facing an allgather hangs; MPI behaves
alike. So before a communicator runs a collective, every rank sends a 256-byte header naming
its call (:mod:`ringpipe.comm.header`: collective, number, dtype, element count, op, root and a
fingerprint of the shape and other arguments) along the recursive doubling pattern. After
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
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from ringpipe.comm.doubling import doubling_steps
from ringpipe.comm.header import (
    COLLECTIVES,
    EAGER_BYTES,
    HEADER_BYTES,
    HEADER_TAG,
    TEXT_BYTES,
    CallInfo,
    HeaderState,
    InvalidCallError,
    MismatchError,
    invalid_message,
    mismatch_message,
    next_seq,
    scratch,
)

if TYPE_CHECKING:
    from ringpipe.comm.base import Communicator

__all__ = ["checks_enabled", "check_call", "exchange_headers", "settle", "describe_calls", "disagreement"]


def checks_enabled() -> bool:
    """The process default: on unless ``RINGPIPE_CHECK_CALLS`` is 0, false, no or off."""
    return os.environ.get("RINGPIPE_CHECK_CALLS", "1").strip().lower() not in ("0", "false", "no", "off")


def home_device(comm: Communicator) -> torch.device:
    """Where ``comm`` takes tensors: its pinned device (CUDA under NCCL), else the CPU."""
    device = getattr(comm, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


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
        desc = {"collective": coll, "seq": seq}
        for k, v in fields.items():
            if isinstance(v, torch.dtype):
                v = str(v).removeprefix("torch.")
            elif hasattr(v, "value") and not isinstance(v, (int, float)):
                v = v.value
            desc[k] = v
        text = None
    try:
        exchange_headers(comm, call, desc, text)
    except InvalidCallError as exc:
        raise exc.with_traceback(None) from problem
    return seq
