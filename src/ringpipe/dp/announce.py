"""Announcements: a small header before each data-parallel collective, so that joined ranks can take part.

Why: a rank inside :func:`ringpipe.dp.join.join` has left the training loop, so it cannot know
which collective the others call next (an optimizer step, SyncBatchNorm's statistics, a metric
average). Before each collective, on the engine thread, every rank allreduces a fixed-size
header: a rank with data contributes a one in its own slot and a description of the collective
(operation, reduce op, dtype, element count, device type); a joined rank contributes zeros. From the sum
every rank learns which ranks still have data, and a joined rank learns what comes next: it
takes part in allreduces with the identity of the reduce op (zeros for Sum and Average, so an
Average is taken over the ranks with data), in barriers and in optimizer steps. Other
collectives raise :class:`JoinError` on every rank instead of hanging.

Collectives called directly on a communicator, outside ``ringpipe.dp`` and ``ringpipe.api``,
are not announced and must not be used while a rank is joined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.dp.engine import Engine, EngineError

__all__ = [
    "OPS",
    "SERVED",
    "JoinError",
    "Note",
    "announce",
    "device_of",
    "exchange",
    "finish",
    "identity",
    "refuse",
    "run_announced",
    "wire_op",
]

# Every announced operation; the header carries its position (plus one; zero: joined).
OPS = ("step", "bucket", "apply", "allreduce", "barrier", "allgather", "broadcast", "reducescatter", "alltoall",
       "broadcast_object", "allgather_object")
# The operations a joined rank takes part in.
SERVED = frozenset({"step", "bucket", "apply", "allreduce", "barrier"})
_REDUCE_OPS = tuple(ReduceOp)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_FIELDS = 5  # operation, reduce op, dtype, element count, on a GPU


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


def exchange(
    comm: Communicator,
    op: str | None,
    tensor: torch.Tensor | None = None,
    reduce_op: ReduceOp | None = None,
) -> Note:
    """Allreduce one header (call on the engine thread); ``op=None`` on a rank that has joined."""
    size = comm.size
    header = torch.zeros(size + _FIELDS, dtype=torch.float64, device=comm._object_device())
    if op is not None:
        header[comm.rank] = 1.0
        header[size] = OPS.index(op) + 1
        if reduce_op is not None:
            header[size + 1] = _REDUCE_OPS.index(reduce_op) + 1
        if tensor is not None:
            header[size + 2] = _DTYPES.index(tensor.dtype) + 1 if tensor.dtype in _DTYPES else 0
            header[size + 3] = tensor.numel()
            header[size + 4] = float(tensor.device.type == "cuda")
    comm.allreduce(header, ReduceOp.SUM)
    values = header.cpu().tolist()
    have_data = tuple(r for r in range(size) if values[r] > 0.5)
    joined = tuple(r for r in range(size) if values[r] <= 0.5)
    count = len(have_data)
    if count == 0:
        return Note("", (), joined)
    code, rop, dtype, numel, cuda = (round(v / count) for v in values[size:])
    return Note(
        OPS[code - 1] if 0 < code <= len(OPS) else f"unknown operation {code}",
        have_data,
        joined,
        _REDUCE_OPS[rop - 1] if 0 < rop <= len(_REDUCE_OPS) else None,
        _DTYPES[dtype - 1] if 0 < dtype <= len(_DTYPES) else None,
        numel,
        cuda == 1,
    )


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def announce(
    comm: Communicator, op: str, tensor: torch.Tensor | None = None, reduce_op: ReduceOp | None = None
) -> Note:
    """Announce ``op`` from a rank with data (on the engine thread); raise if a joined rank cannot serve it."""
    note = exchange(comm, op, tensor, reduce_op)
    if note.joined and op not in SERVED:
        raise JoinError(
            f"{op} called on {_ranks(note.have_data)} while {_ranks(note.joined)} had joined: a rank inside "
            f"join() takes part only in optimizer steps, allreduce and barrier; call {op} before the first "
            "rank joins or after join() returns on every rank"
        )
    if op == "allreduce" and note.joined and tensor is not None and tensor.dtype not in _DTYPES:
        raise JoinError(
            f"allreduce of a {tensor.dtype} tensor while {_ranks(note.joined)} had joined: joined ranks take "
            f"part in allreduces of {', '.join(str(d) for d in _DTYPES)} only"
        )
    return note


def refuse(comm: Communicator, note: Note) -> JoinError:
    """The error a joined rank raises for a collective it cannot take part in."""
    return JoinError(
        f"join on rank {comm.rank}: {_ranks(note.have_data)} called {note.op}, which a rank that has joined "
        "cannot take part in (it serves optimizer steps, allreduce and barrier); call it before the first "
        "rank joins or after join() returns on every rank"
    )


def run_announced(comm: Communicator, op: str, fn: Callable[[], Any], name: str | None = None) -> Any:
    """Run ``fn`` (a collective ``op`` other than allreduce) on the engine after announcing it."""

    def task() -> Any:
        announce(comm, op)
        return fn()

    return Engine.of(comm).run(task, name=name or op)


def identity(reduce_op: ReduceOp, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    """A joined rank's contribution to an allreduce: the identity element of ``reduce_op``."""
    if reduce_op in (ReduceOp.SUM, ReduceOp.AVERAGE):
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


def wire_op(reduce_op: ReduceOp, note: Note) -> ReduceOp:
    """The op to reduce with: an Average while ranks are joined is a Sum divided by :func:`finish`."""
    return ReduceOp.SUM if reduce_op is ReduceOp.AVERAGE and note.joined else reduce_op


def finish(tensor: torch.Tensor, reduce_op: ReduceOp, note: Note) -> None:
    """Complete an Average reduced as a Sum while ranks were joined: divide by the ranks with data."""
    if reduce_op is ReduceOp.AVERAGE and note.joined:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            tensor.div_(note.count)
        else:
            tensor.div_(note.count, rounding_mode="floor")
