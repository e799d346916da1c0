"""The header of an announcement (:mod:`ringpipe.check.announcement`): what it says, how it travels, how it is read.

A header is a list of int64 words: per rank a have-data flag and a fingerprint of its call,
then the summed description of the collective (operation, reduce op, dtype, element count,
device), whether some call was invalid, and what a rank posted right behind it. It travels as
float32 (each word as six 12-bit digits, so that sums stay exact up to 4096 ranks) followed by
a payload area of :attr:`Engine.ride <ringpipe.core.engine.Engine>` elements, in which an
optimizer step's first gradients ride. Reading a summed header tells every rank which ranks
have data and what comes next; if the ranks' calls differ, or one is invalid, every rank
raises the same error (after completing, with zeros, any data another rank posted behind its
header).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ringpipe.check.call import (
    InvalidCallError,
    MismatchError,
    announced_fields,
    disagreement,
    fingerprint,
)
from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.core.engine import Engine

__all__ = ["OPS", "RIDE_CAP", "GROW_CAP", "RIDING", "SERVED", "DTYPES", "Note", "Reorder", "announcement_bytes",
           "decode", "grow_area", "header", "message", "read", "read_message", "rides", "with_payload"]

# Every announced operation; the header carries its position (plus one; zero: joined).
OPS = ("step", "bucket", "apply", "allreduce", "barrier", "allgather", "broadcast", "reducescatter", "alltoall",
       "broadcast_object", "allgather_object")
# The operations a joined rank takes part in.
SERVED = frozenset({"step", "bucket", "apply", "allreduce", "barrier"})
_REDUCE_OPS = tuple(ReduceOp)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_FIELDS = 5  # operation, reduce op, dtype, element count, on a GPU (then: invalid calls)
# After them: the element count and dtype of data posted right behind the header (an optimizer
# step's first bucket), so that on a disagreement the other ranks can complete that allreduce.
_TAIL = 3
#: The most gradient elements an optimizer step's header carries (512 KiB of float32): larger
#: first buckets send the rest right behind it. A 1 MiB first bucket (the default) of float32
#: gradients is 262,144 elements; the transformer of the trainer (72,224) rides whole.
RIDE_CAP = 131072
#: The most elements an allreduce of the program grows the payload area to (256 KiB of float32),
#: so that later allreduces of that size ride in their announcement (:func:`grow_area`).
GROW_CAP = 65536
#: The dtypes whose values float32 holds exactly: they ride widened, summed in float32, and are
#: rounded back once (a single rounding of the sum, as a backend's widened half-precision sum).
RIDING = (torch.float32, torch.float16, torch.bfloat16)
_DIGIT_BITS, _DIGITS = 12, 6  # an int64 word (at most 72 bits) as six float32 digits
_SHIFTS = torch.arange(_DIGITS, dtype=torch.int64) * _DIGIT_BITS


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
    #: The summed payload area of the message (a joined rank's share of a step's first gradients).
    payload: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def count(self) -> int:
        """The number of ranks that still have data."""
        return len(self.have_data)


def announcement_bytes(comm: Communicator) -> int:
    """The length in bytes of every announcement on ``comm`` (the header's digits and the payload area)."""
    return 4 * (_DIGITS * (2 * comm.size + _FIELDS + _TAIL) + Engine.of(comm).ride)


def rides(comm: Communicator, reduce_op: ReduceOp | None, dtype: torch.dtype | None, numel: int, cuda: bool,
          area: int) -> bool:
    """Whether an announced allreduce of this kind travels inside its announcement's payload area.

    The same answer on every rank: the ranks with data ask it of their call, a joined rank of
    the summed header (with the area of the message that carried it), and ranks whose calls
    differ in any of these raise before using the data. Sum and Average of float32, float16 and
    bfloat16 on the CPU, up to the area's length; a joined rank's zeros are the sum's identity.
    """
    return (reduce_op in (ReduceOp.SUM, ReduceOp.AVERAGE) and dtype in RIDING and not cuda
            and 0 < numel <= area and comm._object_device().type == "cpu")


def grow_area(comm: Communicator, note: Note) -> None:
    """After an allreduce too long to ride, lengthen every later announcement so that one of its size rides.

    Called for every header read (on every rank, the joined ones too, in the same order), with
    what the summed header says, so the area's length stays the same on every rank.
    """
    engine = Engine.of(comm)
    if (note.op == "allreduce" and engine.ride < note.numel <= GROW_CAP
            and rides(comm, note.reduce_op, note.dtype, note.numel, note.cuda, note.numel)):
        engine.ride = note.numel


def with_payload(note: Note, payload: torch.Tensor) -> Note:
    if not payload.numel():
        return note
    return Note(note.op, note.have_data, note.joined, note.reduce_op, note.dtype, note.numel, note.cuda, payload)


def message(comm: Communicator, digits: torch.Tensor, wire: torch.Tensor | None, ride: int) -> torch.Tensor:
    """The header's digits, then the payload area: ``wire[:ride]``, zeros after it."""
    area = Engine.of(comm).ride
    if ride > area:
        raise RuntimeError(f"{ride} elements cannot ride in an announcement of {area} on {comm.name}")
    device = comm._object_device()
    parts = [digits.to(device)]
    if ride:
        assert wire is not None
        parts.append(wire[:ride].to(device, torch.float32))
    if area > ride:
        parts.append(torch.zeros(area - ride, dtype=torch.float32, device=device))
    return torch.cat(parts)  # one pass (a new tensor: the sum is made in place on it)


def _encode(header: torch.Tensor) -> torch.Tensor:
    """Each non-negative int64 word as six 12-bit digits in float32 (sums stay exact up to 4096 ranks)."""
    return ((header.unsqueeze(1) >> _SHIFTS) & ((1 << _DIGIT_BITS) - 1)).flatten().to(torch.float32)


def decode(message: torch.Tensor, size: int) -> list[int]:
    """The summed int64 words of a summed header (its first ``size`` digits)."""
    digits = [round(v) for v in message[:size].cpu().tolist()]
    return [sum(digits[i + j] << (_DIGIT_BITS * j) for j in range(_DIGITS)) for i in range(0, size, _DIGITS)]


_CONSTANT: dict[tuple[Any, ...], torch.Tensor] = {}


def header(comm: Communicator, op: str | None, tensor: torch.Tensor | None, reduce_op: ReduceOp | None,
            detail: dict[str, Any] | None, problem: BaseException | None,
            behind: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """This rank's header as digits (:func:`_encode`) and the fields it fingerprints."""
    size = comm.size
    fields = None if op is None else announced_fields(op, tensor, reduce_op, detail)
    constant = tensor is None and reduce_op is None and not detail and problem is None
    key = (op or "", comm.rank, size, None if behind is None else (behind.numel(), behind.dtype))
    if constant and key in _CONSTANT:  # a joined rank's and an optimizer step's header never change
        return _CONSTANT[key], fields
    words = torch.zeros(2 * size + _FIELDS + _TAIL, dtype=torch.int64)
    if op is not None:
        words[comm.rank] = 1 if behind is None else 2  # 2: data follows the header without waiting for it
        if behind is not None:
            words[2 * size + _FIELDS + 1] = behind.numel()
            words[2 * size + _FIELDS + 2] = DTYPES.index(behind.dtype) + 1
        words[size + comm.rank] = fingerprint(fields)
        words[2 * size] = OPS.index(op) + 1
        if reduce_op is not None:
            words[2 * size + 1] = _REDUCE_OPS.index(reduce_op) + 1
        if tensor is not None:
            words[2 * size + 2] = DTYPES.index(tensor.dtype) + 1 if tensor.dtype in DTYPES else 0
            words[2 * size + 3] = tensor.numel()
            words[2 * size + 4] = int(tensor.device.type == "cuda")
        words[2 * size + _FIELDS] = int(problem is not None)
    digits = _encode(words)
    if constant:
        _CONSTANT[key] = digits
    return digits, fields


_AGREED: dict[tuple[int, bytes], Note] = {}


def read_message(comm: Communicator, message: torch.Tensor, size: int, fields: dict[str, Any] | None,
                 problem: BaseException | None, behind: bool = False, by_name: bool = False) -> Note:
    """:func:`read` of a summed message's first ``size`` digits, remembering the headers every rank agreed on.

    A header sum that every rank agreed on always reads the same (only a disagreement depends on
    the other arguments, and it raises), so the step of a training loop, whose summed header is the
    same every time, is decoded once rather than at every step.
    """
    key = None
    if message.device.type == "cpu":
        key = (comm.size, message[:size].numpy().tobytes())
        agreed = _AGREED.get(key)
        if agreed is not None:
            return agreed
    note = read(comm, decode(message, size), fields, problem, behind, by_name)
    if key is not None and note.count:
        if len(_AGREED) >= 64:
            _AGREED.clear()
        _AGREED[key] = note
    return note


def read(comm: Communicator, values: list[int], fields: dict[str, Any] | None,
          problem: BaseException | None, behind: bool = False, by_name: bool = False) -> Note:
    """What every rank learns from the summed header (``behind``: this rank posted data behind it).

    ``by_name``: read on the thread running the announced task, whose named operations may be
    matched by name (:class:`Reorder`); an optimizer step's first message is not.
    """
    size = comm.size
    have_data = tuple(r for r in range(size) if values[r] > 0)
    joined = tuple(r for r in range(size) if values[r] <= 0)
    count = len(have_data)
    if count == 0:
        return Note("", (), joined)
    if values[2 * size + _FIELDS] or len({values[size + r] for r in have_data}) > 1:
        _drain(comm, values, behind)
        _disagree(comm, fields, problem, by_name)
    code, rop, dtype, numel, cuda = (v // count for v in values[2 * size : 2 * size + _FIELDS])
    return Note(
        OPS[code - 1] if 0 < code <= len(OPS) else f"unknown operation {code}",
        have_data,
        joined,
        _REDUCE_OPS[rop - 1] if 0 < rop <= len(_REDUCE_OPS) else None,
        DTYPES[dtype - 1] if 0 < dtype <= len(DTYPES) else None,
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
    if numel * len(posted) != values[2 * size + _FIELDS + 1] or not 0 < code <= len(DTYPES):
        raise MismatchError(
            f"{comm.name}: ranks {posted} posted optimizer buckets of different lengths behind their headers; "
            "build the same DistributedOptimizer on every rank"
        )
    zeros = torch.zeros(numel, dtype=DTYPES[code - 1], device=comm._object_device())
    comm.iallreduce(zeros, ReduceOp.SUM).wait()


class Reorder(Exception):
    """The ranks' calls differ, but every rank has the named operation ``key`` current or queued: run it first."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _names_differ(keys: list[list[str]]) -> bool:
    """Whether every rank's current operation is named and they are not all the same name."""
    return all(keys) and len({k[0] for k in keys}) > 1


def _common_key(keys: list[list[str]]) -> str | None:
    """The first of rank 0's keys (current, then queued) that every rank has, unless it is every rank's current."""
    if not all(keys):
        return None  # some rank's current operation is unnamed (or it has joined): order decides
    for key in keys[0]:
        if all(key in mine for mine in keys[1:]):
            return None if all(mine[0] == key for mine in keys) else key
    return None


def _disagree(comm: Communicator, fields: dict[str, Any] | None, problem: BaseException | None,
              by_name: bool = False) -> NoReturn:
    """Every rank (a joined one too) learns every call and raises the same error.

    Or, when the calls differ only in which named operation each rank runs now and some named
    operation is current or queued on every rank, every rank raises :class:`Reorder` with it
    (Horovod matches operations by name, not by order).
    """
    mine = Engine.of(comm).keys() if problem is None and by_name else []
    every = comm._allgather_object((fields, None if problem is None else str(problem), mine))
    invalid = [r for r, (_, p, _) in enumerate(every) if p is not None]
    if invalid:
        r = invalid[0]
        what = every[r][0]["collective"] if every[r][0] else "a collective"
        raise InvalidCallError(
            f"{what} on {comm.name}: rank {r} made an invalid call: {every[r][1]} (raised on every rank; "
            "no tensor was modified)"
        )
    keys = [k for _, _, k in every]
    common = _common_key(keys)
    if common is None and _names_differ(keys):
        common, keys = _wait_for_names(comm, keys)
    if common is not None:
        raise Reorder(common)
    calls = [(r, f) for r, (f, _, _) in enumerate(every) if f is not None]
    text = disagreement(comm.name, calls)
    if _names_differ(keys):
        waits = "; ".join(f"rank {r} has {', '.join(repr(n) for n in k)}" for r, k in enumerate(keys))
        text += (f" (named operations match by name, whatever their order, but for {_name_wait_s():.0f} s no name "
                 f"was posted on every rank: {waits})")
    raise MismatchError(text)


def _name_wait_s() -> float:
    """How long ranks whose current named operations differ wait for a name they all have (the stall threshold)."""
    try:
        seconds = float(os.environ.get("RINGPIPE_STALL_CHECK_SECONDS", "") or 60)
    except ValueError:
        seconds = 60.0
    return max(seconds, 5.0)


def _wait_for_names(comm: Communicator, keys: list[list[str]]) -> tuple[str | None, list[list[str]]]:
    """Poll every rank's named operations until one is posted on every rank (as Horovod waits for a tensor
    name to be ready on all ranks), for at most :func:`_name_wait_s`; rank 0's clock decides for all."""
    engine = Engine.of(comm)
    start, pause, limit = time.monotonic(), 0.001, _name_wait_s()
    while True:
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
        every = comm._allgather_object((engine.keys(), time.monotonic() - start))
        keys = [k for k, _ in every]
        common = _common_key(keys)
        if common is not None or every[0][1] > limit or not all(keys):
            return common, keys
