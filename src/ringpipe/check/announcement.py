"""Announcements: a small header before each data-parallel collective, so that joined ranks can take part.

Why: a rank inside :func:`ringpipe.dp.join.join` has left the training loop, so it cannot know
which collective the others call next (an optimizer step, SyncBatchNorm's statistics, a metric
average). Before each collective, on the engine thread, every rank allreduces a fixed-size
header: a rank with data contributes a one in its own slot, a fingerprint of its call (every
argument that must agree: collective, dtype, shape, reduce op, root rank, scale factors...) and
a description of the collective (operation, reduce op, dtype, element count, device type); a
joined rank contributes zeros. Ranks with data whose fingerprints differ, or a rank whose call is
invalid, make every rank raise the same error before any data moves — the cross-rank check of
the data-parallel API, at no cost beyond the header. From the sum
every rank learns which ranks still have data, and a joined rank learns what comes next: it
takes part in allreduces with the identity of the reduce op (zeros for Sum and Average; an
Average still divides by the full size, as in Horovod), in barriers and in optimizer steps.
Other collectives raise :class:`JoinError` on the ranks that called them, as in Horovod, while
the joined ranks go on waiting.

An optimizer step costs no message of its own: its header rides in front of the first
gradients. Every announcement on a communicator is one float32 message of the same length,
the header (each int64 word as six 12-bit digits, exact in float32 sums over up to 4096 ranks)
followed by a payload area (:mod:`ringpipe.check.announcement_header`) of :attr:`Engine.ride <ringpipe.core.engine.Engine>` elements. An
optimizer step's first message fills that area with the start of its first bucket
(:func:`start_exchange`), and a Sum or Average allreduce that fits fills it with its data
(:func:`announce` with ``payload``), so that it too is one message (its negotiation and its
reduction at once). Every other announcement leaves the area zero, and so does a joined rank,
which cannot know which of them comes next but always posts a message of the right length and
contributes zeros (the sum's identity). The area's length changes only in step on every rank:
when a ``DistributedOptimizer`` with join support is built (collectively), to its whole first
bucket (up to :data:`RIDE_CAP` elements); and after an allreduce too long to ride, to its length
(up to :data:`GROW_CAP`), read from the summed header that every rank reads
(:func:`~ringpipe.check.announcement_header.grow_area`).

Collectives called directly on a communicator, outside ``ringpipe.core``, ``ringpipe.dp`` and the
faces, are not announced and must not be used while a rank is joined.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ringpipe.check.announcement_header import (
    DTYPES,
    GROW_CAP,
    OPS,
    RIDE_CAP,
    RIDING,
    SERVED,
    Note,
    Reorder,
    announcement_bytes,
    grow_area,
    header,
    message,
    read_message,
    rides,
    with_payload,
)
from ringpipe.check.call import InvalidCallError, MismatchError
from ringpipe.comm.base import CommError, Communicator, ReduceOp, Work
from ringpipe.comm.events import internal, negotiating
from ringpipe.core.engine import Engine
from ringpipe.core.errors import EngineInvalidCallError, EngineMismatchError, JoinError

__all__ = [
    "OPS",
    "SERVED",
    "Note",
    "Pending",
    "RIDE_CAP",
    "GROW_CAP",
    "RIDING",
    "announce",
    "announcement_bytes",
    "checks",
    "device_of",
    "exchange",
    "identity",
    "rides",
    "run_announced",
    "settle",
    "start_exchange",
]


def exchange(
    comm: Communicator,
    op: str | None,
    tensor: torch.Tensor | None = None,
    reduce_op: ReduceOp | None = None,
    detail: dict[str, Any] | None = None,
    problem: BaseException | None = None,
    payload: torch.Tensor | None = None,
) -> Note:
    """Allreduce one header (call on the engine thread); ``op=None`` on a rank that has joined.

    The header also carries a fingerprint of each rank's call (``detail``: further arguments
    that must agree, such as the root rank or scale factors) and whether it was invalid
    (``problem``); if the ranks with data differ, or one is invalid, every rank raises the same
    :class:`MismatchError` or :class:`InvalidCallError` before any data moves. ``payload``: a
    flat tensor that travels (as float32) in the payload area; its sum is the note's payload.
    """
    settle(comm)
    digits, fields = header(comm, op, tensor, reduce_op, detail, problem)
    n = 0 if payload is None else payload.numel()
    wire = message(comm, digits, payload, n)
    # ringpipe's bookkeeping, listed apart from the program's calls, unless the call's data is in it
    with negotiating() if n else internal():
        comm.allreduce(wire, ReduceOp.SUM)
    note = read_message(comm, wire, digits.numel(), fields, problem, by_name=True)
    note = with_payload(note, wire[digits.numel():])
    grow_area(comm, note)
    return note


class Pending:
    """A step's first message in flight (:func:`start_exchange`); :meth:`note` waits for it and reads it once.

    Reading it copies the summed first gradients back into the bucket and calls ``on_note``;
    later calls return the same note or raise the same error.
    """

    __slots__ = ("comm", "message", "work", "fields", "size", "target", "on_note", "behind", "_lock", "_note",
                 "_error")

    def __init__(self, comm: Communicator, message: torch.Tensor, work: Work | None, fields: dict[str, Any] | None,
                 size: int, target: torch.Tensor | None, on_note: Callable[[Note], None] | None,
                 behind: bool) -> None:
        self.comm, self.message, self.work, self.fields = comm, message, work, fields
        self.size, self.target, self.on_note, self.behind = size, target, on_note, behind
        self._lock = threading.Lock()
        self._note: Note | None = None
        self._error: BaseException | None = None

    def note(self) -> Note:
        # Another thread reading it meanwhile (step() waiting, the engine settling before its next
        # collective) waits on the lock and gets the same note: on_note has run before either returns.
        with self._lock:
            if self._note is None and self._error is None:
                try:
                    if self.work is not None:
                        self.work.wait()
                    self._note = read_message(self.comm, self.message, self.size, self.fields, None, self.behind)
                    if self.target is not None:
                        self.target.copy_(self.message[self.size : self.size + self.target.numel()])
                    if self.on_note is not None:
                        self.on_note(self._note)
                except BaseException as exc:  # noqa: BLE001 - raised again to every reader
                    self._error = exc
                finally:
                    if _UNREAD.get(self.comm) is self:
                        del _UNREAD[self.comm]
            if self._error is not None:
                raise self._error
            assert self._note is not None
            return self._note

    def wait(self) -> Note:
        """:meth:`note`, its cross-rank errors raised as the engine's (as a failed engine task raises them)."""
        try:
            return self.note()
        except InvalidCallError as exc:
            raise EngineInvalidCallError(str(exc)) from exc
        except MismatchError as exc:
            raise EngineMismatchError(str(exc)) from exc


# The step's first message each communicator has in flight and not read yet: read before the next
# collective is posted, since on a disagreement reading it runs the exchange that raises the error.
_UNREAD: weakref.WeakKeyDictionary[Communicator, Pending] = weakref.WeakKeyDictionary()


def settle(comm: Communicator) -> None:
    """Read the step's first message still in flight on ``comm`` (call on the engine thread before posting)."""
    pending = _UNREAD.get(comm)
    if pending is not None:
        pending.note()


def start_exchange(comm: Communicator, op: str, wire: torch.Tensor, ride: int, behind: int,
                   on_note: Callable[[Note], None] | None = None, blocking: bool = False) -> Pending:
    """Post the header of ``op`` with the first ``ride`` elements of ``wire`` in its payload area.

    ``behind``: elements of ``wire`` the caller posts as a sum-allreduce right behind, without
    reading the header first (a thread-safe backend's overlap); if the ranks' calls differ, the
    ranks that made another call complete that allreduce with zeros (the header says its
    length), then every rank raises as usual. ``blocking`` (MPI, whose blocking and
    non-blocking collectives do not match): a blocking allreduce, as a joined rank's.
    Nothing is read until :meth:`Pending.note` (or :func:`settle` before the next collective).
    """
    settle(comm)
    tail = wire[ride:] if behind else None
    assert tail is None or tail.numel() == behind, "the elements posted behind are those after the ride"
    digits, fields = header(comm, op, None, None, None, None, tail)
    out = message(comm, digits, wire, ride)
    # with gradients in it, the message is the program's reduction, not only ringpipe's bookkeeping
    with internal() if not ride else contextlib.nullcontext():
        if blocking:
            comm.allreduce(out, ReduceOp.SUM)
            work = None
        else:
            work = comm.iallreduce(out, ReduceOp.SUM)
    pending = Pending(comm, out, work, fields, digits.numel(), wire[:ride] if ride else None, on_note, bool(behind))
    _UNREAD[comm] = pending
    return pending


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


#: What a refused argument raises before an announcement (a non-tensor, a bad root...).
ARGUMENT_ERRORS = (TypeError, ValueError, CommError)


def announce(
    comm: Communicator,
    op: str,
    tensor: torch.Tensor | None = None,
    reduce_op: ReduceOp | None = None,
    detail: dict[str, Any] | None = None,
    validate: Callable[[], None] | None = None,
    payload: torch.Tensor | None = None,
) -> Note:
    """Announce ``op`` from a rank with data (on the engine thread); raise if a joined rank cannot serve it.

    ``validate`` checks this rank's arguments; if it raises, the call is announced as invalid
    and every rank raises its error (no rank is left waiting in the collective). ``payload``: an
    allreduce's data, summed in the announcement itself (only where :func:`rides` says so, on
    every rank alike); the note's ``payload`` then starts with the sum.
    """
    problem = None
    if validate is not None:
        try:
            validate()
        except ARGUMENT_ERRORS as exc:
            problem = exc
    while True:
        try:
            note = exchange(comm, op, tensor, reduce_op, detail, problem, payload)
            break
        except Reorder as reorder:  # every rank runs the named operation they all have first, then retries
            Engine.of(comm).run_queued(reorder.key)
    if note.joined and op not in SERVED:
        name = {"allgather_object": "allgather", "broadcast_object": "broadcast"}.get(op, op)
        hint = " Specify sparse_as_dense=True if using DistributedOptimizer." if name == "allgather" else ""
        raise JoinError(
            f"{name.capitalize()} is not supported with Join at this time.{hint} ({op} called on "
            f"{_ranks(note.have_data)} while {_ranks(note.joined)} had joined: a rank inside join() takes part "
            f"only in optimizer steps, allreduce and barrier; call {op} before the first rank joins or after "
            "join() returns on every rank)"
        )
    if op == "allreduce" and note.joined and tensor is not None and tensor.dtype not in DTYPES:
        raise JoinError(
            f"allreduce of a {tensor.dtype} tensor while {_ranks(note.joined)} had joined: joined ranks take "
            f"part in allreduces of {', '.join(str(d) for d in DTYPES)} only"
        )
    return note


def checks(comm: Communicator, what: str, tensor: torch.Tensor | None = None,
           root: int | None = None, problem: BaseException | None = None) -> Callable[[], None]:
    """A ``validate`` for :func:`announce`: the communicator's checks of a tensor and a root rank.

    ``problem``: an error this rank found before (a root outside the process set, a name in
    flight), raised first.
    """

    def validate() -> None:
        if problem is not None:
            raise problem
        if tensor is not None:
            comm._check_tensor(tensor, what)
        if root is not None:
            comm._check_root(root, what)

    return validate


def run_announced(
    comm: Communicator,
    op: str,
    fn: Callable[[], Any],
    name: str | None = None,
    tensor: torch.Tensor | None = None,
    detail: dict[str, Any] | None = None,
    validate: Callable[[], None] | None = None,
    key: str | None = None,
) -> Any:
    """Run ``fn`` (a collective ``op`` other than allreduce) on the engine after announcing it.

    ``tensor``, ``detail`` and ``validate`` as for :func:`announce`: the call is compared
    across ranks before ``fn`` runs. ``key``: the name it matches by across ranks
    (:class:`~ringpipe.core.engine.Engine`).
    """

    def task() -> Any:
        announce(comm, op, tensor, None, detail, validate)
        return fn()

    return Engine.of(comm).run(task, name=name or op, key=key)


def identity(reduce_op: ReduceOp, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    """A joined rank's contribution to an allreduce: the identity element of ``reduce_op``."""
    if reduce_op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM):  # a zero vector leaves Adasum's sum as is
        return torch.zeros(numel, dtype=dtype, device=device)
    if reduce_op is ReduceOp.PRODUCT:
        return torch.ones(numel, dtype=dtype, device=device)
    high = reduce_op is ReduceOp.MIN
    if dtype == torch.bool:
        value: float | int | bool = high
    elif dtype.is_floating_point:
        value = float("inf") if high else float("-inf")
    else:
        info = torch.iinfo(dtype)
        value = info.max if high else info.min
    return torch.full((numel,), value, dtype=dtype, device=device)


def device_of(comm: Communicator, note: Note) -> torch.device:
    """Where a joined rank puts its contribution: a GPU when the ranks with data reduce GPU tensors."""
    if note.cuda and torch.cuda.is_available():
        device = comm._object_device()
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
