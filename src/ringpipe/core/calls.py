"""What every call of the Horovod-style API shares: its process set, its name, its place on the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.comm.events import name_next
from ringpipe.core.engine import Engine, Handle
from ringpipe.core.process_sets import ProcessSet, resolve
from ringpipe.core.world import current

__all__ = ["Call", "parse_op", "set_detail"]


def parse_op(op: ReduceOp | str | None, average: bool | None, default: ReduceOp = ReduceOp.AVERAGE) -> ReduceOp:
    """Horovod's ``op`` / deprecated ``average`` pair (both given is an error, as in Horovod)."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.parse(op if op is not None else default)


def set_detail(process_set: ProcessSet | None) -> dict[str, Any]:
    """The process set as an announced argument (every member must name the same set)."""
    return {"process_set": 0 if process_set is None else process_set.process_set_id}


class Call:
    """One API call: the communicator of its process set and its name.

    As in Horovod, an operation is known across ranks by its tensor name (``allreduce.grad_w``):
    ranks match named operations by that name, whatever order they were posted in (see
    :class:`~ringpipe.core.engine.Engine`), and posting a name still in flight (submitted, not yet
    synchronized) raises :class:`ValueError` at once on the rank that posted it, posting nothing.
    """

    def __init__(self, what: str, process_set: ProcessSet | None, name: str | None) -> None:
        self.what = what
        self.comm: Communicator
        self.comm, self.ranks = resolve(process_set, what)
        self.detail = set_detail(process_set)
        self.name = name
        key = self.key
        if key is not None:
            earlier = current().names.get(key)
            if earlier is not None and not earlier.synchronized():
                raise ValueError(
                    f"{what}: an operation named {name!r} is still in flight on this rank; synchronize it first or "
                    "use another name (Horovod: Requested to allreduce, allgather, or broadcast a tensor with the "
                    "same name as another tensor that is currently being processed.  If you want to request another "
                    "tensor, use a different tensor name.)"
                )
        # The operation this call queues next on the engine carries the name (a timeline row).
        name_next(self.tensor_name)

    @property
    def key(self) -> str | None:
        """The name the operation matches by across ranks (None: unnamed, matched by its place in the order)."""
        if self.name is not None:
            return f"{self.what}.{self.name}"
        return "barrier" if self.what == "barrier" else None

    @property
    def engine(self) -> Engine:
        return Engine.of(self.comm)

    @property
    def tensor_name(self) -> str | None:
        """The name its events carry (a timeline row), as Horovod names tensors: ``allreduce.avg_loss``."""
        return f"{self.what}.{self.name}" if self.name is not None else None

    def submit(self, task: Callable[[], Any], then: Callable[[Any], Any] | None = None) -> Handle:
        name_next(self.tensor_name)
        handle = self.engine.submit(task, then, name=self.name or self.what, key=self.key)
        key = self.key
        if self.name is not None and key is not None:
            current().names[key] = handle
        return handle
