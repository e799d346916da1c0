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

Collectives called directly on a communicator, outside ``ringpipe.dp`` and ``ringpipe.api``,
are not announced and must not be used while a rank is joined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from ringpipe.comm.base import CommError, Communicator, ReduceOp
from ringpipe.comm.consistency import disagreement
from ringpipe.comm.events import internal
from ringpipe.comm.header import InvalidCallError, MismatchError, fingerprint
from ringpipe.dp.engine import Engine, EngineError

__all__ = [
    "OPS",
    "SERVED",
    "JoinError",
    "Note",
    "Pending",
    "announce",
    "checks",
    "device_of",
    "exchange",
    "identity",
    "run_announced",
    "start_exchange",
]

# Every announced operation; the header carries its position (plus one; zero: joined).
OPS = ("step", "bucket", "apply", "allreduce", "barrier", "allgather", "broadcast", "reducescatter", "alltoall",
       "broadcast_object", "allgather_object")
# The operations a joined rank takes part in.
SERVED = frozenset({"step", "bucket", "apply", "allreduce", "barrier"})
_REDUCE_OPS = tuple(ReduceOp)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_FIELDS = 5  # operation, reduce op, dtype, element count, on a GPU (then: invalid calls)
# After them: the element count and dtype of data posted right behind the header (an optimizer
# step's first bucket), so that on a disagreement the other ranks can complete that allreduce.
_TAIL = 3


class JoinError(EngineError):
    """A collective was called while a rank had joined, and joined ranks cannot take part in it."""


@dataclass(frozen=True)
class Note:
    """What every rank learnt from one header."""

    op: str  # "" once every rank has joined
    have_data: tuple[int, ...]
    joined: tuple[int, ...]
    reduce_op: ReduceOp | None = None
    dtype: torch.dtype | None = None
    numel: int = 0
    cuda: bool = False

    @property
    def count(self) -> int:
        """The number of ranks that still have data."""
        return len(self.have_data)


def _fields(op: str, tensor: torch.Tensor | None, reduce_op: ReduceOp | None,
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


def exchange(
    comm: Communicator,
    op: str | None,
    tensor: torch.Tensor | None = None,
    reduce_op: ReduceOp | None = None,
    detail: dict[str, Any] | None = None,
    problem: BaseException | None = None,
) -> Note:
    """Allreduce one header (call on the engine thread); ``op=None`` on a rank that has joined.

    The header also carries a fingerprint of each rank's call (``detail``: further arguments
    that must agree, such as the root rank or scale factors) and whether it was invalid
    (``problem``); if the ranks with data differ, or one is invalid, every rank raises the same
    :class:`MismatchError` or :class:`InvalidCallError` before any data moves.
    """
    wire, fields = _header(comm, op, tensor, reduce_op, detail, problem)
    with internal():  # ringpipe's bookkeeping: listed apart from the program's calls
        comm.allreduce(wire, ReduceOp.SUM)
    return _read(comm, wire.cpu().tolist(), fields, problem)


class Pending:
    """A header exchange in flight (:func:`start_exchange`); :meth:`note` waits for it and reads it."""

    __slots__ = ("comm", "wire", "work", "fields")

    def __init__(self, comm: Communicator, wire: torch.Tensor, work: Any, fields: dict[str, Any] | None) -> None:
        self.comm, self.wire, self.work, self.fields = comm, wire, work, fields

    def note(self) -> Note:
        self.work.wait()
        return _read(self.comm, self.wire.cpu().tolist(), self.fields, None, behind=True)


def start_exchange(comm: Communicator, op: str, behind: torch.Tensor) -> Pending:
    """Post the header of ``op`` (a call without tensor or problem, such as an optimizer step) without waiting.

    For a thread-safe backend: the caller posts the sum-allreduce of ``behind`` right after the
    header, so the two round trips overlap instead of following each other. The order of
    collectives is the one of :func:`exchange` followed by the data, so a joined rank serves it
    the same way. If the ranks' calls differ, the ranks that made another call first complete
    that allreduce with zeros (the header says its length), then every rank raises as usual.
    """
    wire, fields = _header(comm, op, None, None, None, None, behind)
    with internal():
        work = comm.iallreduce(wire, ReduceOp.SUM)
    return Pending(comm, wire, work, fields)


_CONSTANT: dict[tuple[Any, ...], torch.Tensor] = {}


def _header(comm: Communicator, op: str | None, tensor: torch.Tensor | None, reduce_op: ReduceOp | None,
            detail: dict[str, Any] | None, problem: BaseException | None,
            behind: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """This rank's header (a fresh tensor on the communicator's object device) and the fields it fingerprints."""
    size = comm.size
    fields = None if op is None else _fields(op, tensor, reduce_op, detail)
    constant = op is not None and tensor is None and reduce_op is None and not detail and problem is None
    key = (op or "", comm.rank, size, None if behind is None else (behind.numel(), behind.dtype))
    if constant and key in _CONSTANT:  # an optimizer step's header never changes: build it once
        return _CONSTANT[key].clone(), fields
    header = torch.zeros(2 * size + _FIELDS + _TAIL, dtype=torch.int64)
    if op is not None:
        header[comm.rank] = 1 if behind is None else 2  # 2: data follows the header without waiting for it
        if behind is not None:
            header[2 * size + _FIELDS + 1] = behind.numel()
            header[2 * size + _FIELDS + 2] = _DTYPES.index(behind.dtype) + 1
        header[size + comm.rank] = fingerprint(fields)
        header[2 * size] = OPS.index(op) + 1
        if reduce_op is not None:
            header[2 * size + 1] = _REDUCE_OPS.index(reduce_op) + 1
        if tensor is not None:
            header[2 * size + 2] = _DTYPES.index(tensor.dtype) + 1 if tensor.dtype in _DTYPES else 0
            header[2 * size + 3] = tensor.numel()
            header[2 * size + 4] = int(tensor.device.type == "cuda")
        header[2 * size + _FIELDS] = int(problem is not None)
    wire = header.to(comm._object_device())
    if constant and wire.device.type == "cpu":
        _CONSTANT[key] = wire.clone()
    return wire, fields


def _read(comm: Communicator, values: list[int], fields: dict[str, Any] | None,
          problem: BaseException | None, behind: bool = False) -> Note:
    """What every rank learns from the summed header (``behind``: this rank posted data behind it)."""
    size = comm.size
    have_data = tuple(r for r in range(size) if values[r] > 0)
    joined = tuple(r for r in range(size) if values[r] <= 0)
    count = len(have_data)
    if count == 0:
        return Note("", (), joined)
    if values[2 * size + _FIELDS] or len({values[size + r] for r in have_data}) > 1:
        _drain(comm, values, behind)
        _disagree(comm, fields, problem)
    code, rop, dtype, numel, cuda = (v // count for v in values[2 * size : 2 * size + _FIELDS])
    return Note(
        OPS[code - 1] if 0 < code <= len(OPS) else f"unknown operation {code}",
        have_data,
        joined,
        _REDUCE_OPS[rop - 1] if 0 < rop <= len(_REDUCE_OPS) else None,
        _DTYPES[dtype - 1] if 0 < dtype <= len(_DTYPES) else None,
        numel,
        cuda == 1,
    )


def _drain(comm: Communicator, values: list[int], behind: bool) -> None:
    """On a disagreement, complete with zeros the allreduce that other ranks posted behind their header."""
    size = comm.size
    posted = [r for r in range(size) if values[r] == 2]
    if not posted or behind:
        return
    numel = values[2 * size + _FIELDS + 1] // len(posted)
    code = values[2 * size + _FIELDS + 2] // len(posted)
    if numel * len(posted) != values[2 * size + _FIELDS + 1] or not 0 < code <= len(_DTYPES):
        raise MismatchError(
            f"{comm.name}: ranks {posted} posted optimizer buckets of different lengths behind their headers; "
            "build the same DistributedOptimizer on every rank"
        )
    zeros = torch.zeros(numel, dtype=_DTYPES[code - 1], device=comm._object_device())
    comm.iallreduce(zeros, ReduceOp.SUM).wait()


def _disagree(comm: Communicator, fields: dict[str, Any] | None, problem: BaseException | None) -> NoReturn:
    """Every rank (a joined one too) learns every call and raises the same error."""
    every = comm._allgather_object((fields, None if problem is None else str(problem)))
    invalid = [r for r, (_, p) in enumerate(every) if p is not None]
    if invalid:
        r = invalid[0]
        what = every[r][0]["collective"] if every[r][0] else "a collective"
        raise InvalidCallError(
            f"{what} on {comm.name}: rank {r} made an invalid call: {every[r][1]} (raised on every rank; "
            "no tensor was modified)"
        )
    calls = [(r, f) for r, (f, _) in enumerate(every) if f is not None]
    raise MismatchError(disagreement(comm.name, calls))


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
) -> Note:
    """Announce ``op`` from a rank with data (on the engine thread); raise if a joined rank cannot serve it.

    ``validate`` checks this rank's arguments; if it raises, the call is announced as invalid
    and every rank raises its error (no rank is left waiting in the collective).
    """
    problem = None
    if validate is not None:
        try:
            validate()
        except ARGUMENT_ERRORS as exc:
            problem = exc
    note = exchange(comm, op, tensor, reduce_op, detail, problem)
    if note.joined and op not in SERVED:
        name = {"allgather_object": "allgather", "broadcast_object": "broadcast"}.get(op, op)
        hint = " Specify sparse_as_dense=True if using DistributedOptimizer." if name == "allgather" else ""
        raise JoinError(
            f"{name.capitalize()} is not supported with Join at this time.{hint} ({op} called on "
            f"{_ranks(note.have_data)} while {_ranks(note.joined)} had joined: a rank inside join() takes part "
            f"only in optimizer steps, allreduce and barrier; call {op} before the first rank joins or after "
            "join() returns on every rank)"
        )
    if op == "allreduce" and note.joined and tensor is not None and tensor.dtype not in _DTYPES:
        raise JoinError(
            f"allreduce of a {tensor.dtype} tensor while {_ranks(note.joined)} had joined: joined ranks take "
            f"part in allreduces of {', '.join(str(d) for d in _DTYPES)} only"
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
) -> Any:
    """Run ``fn`` (a collective ``op`` other than allreduce) on the engine after announcing it.

    ``tensor``, ``detail`` and ``validate`` as for :func:`announce`: the call is compared
    across ranks before ``fn`` runs.
    """

    def task() -> Any:
        announce(comm, op, tensor, None, detail, validate)
        return fn()

    return Engine.of(comm).run(task, name=name or op)


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
