"""Horovod's data movement every face calls: allgather, broadcast, alltoall, objects and barrier, on any process set.

Root ranks are world ranks, as in Horovod, also on a process set. Every call is announced with
the arguments the ranks must agree on (dtype, trailing shape, root rank, set), so ranks that
disagree all raise before data moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringpipe.check.announcement import announce, checks, run_announced
from ringpipe.core import ops
from ringpipe.core.engine import Handle
from ringpipe.core.process_sets import ProcessSet, global_process_set, set_root

from .basics import synchronize
from .calls import Call

__all__ = [
    "allgather",
    "allgather_async",
    "allgather_object",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "grouped_allgather",
    "grouped_allgather_async",
]


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ); differentiable."""
    call = Call("allgather", process_set, name)
    return ops.allgather(call.comm, tensor, call.detail)


def _gather_task(call: Call, x: torch.Tensor) -> Any:
    comm = call.comm

    def task() -> torch.Tensor:
        announce(comm, "allgather", x, detail=call.detail, validate=checks(comm, "allgather", x))
        parts = comm.allgather(x)
        return torch.stack(parts) if x.dim() == 0 else torch.cat(parts, 0)

    return task


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    call = Call("allgather", process_set, name)
    return call.submit(_gather_task(call, tensor.detach().clone().contiguous()))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Gather several tensors, in order on the engine; ``synchronize`` returns the list."""
    call = Call("grouped_allgather", process_set, name)
    tasks = [_gather_task(call, t.detach().clone().contiguous()) for t in tensors]
    return call.submit(lambda: [task() for task in tasks])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Gather several tensors (differentiable, one collective per tensor)."""
    return [allgather(t, name and f"{name}.{i}", process_set) for i, t in enumerate(tensors)]


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor with ``root_rank``'s values; differentiable."""
    call = Call("broadcast", process_set, name)
    root, problem = set_root(call.ranks, root_rank, "broadcast")
    return ops.broadcast(call.comm, tensor, root, call.detail, problem)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    call = Call("broadcast", process_set, name)
    comm = call.comm
    root, problem = set_root(call.ranks, root_rank, "broadcast")

    def task() -> torch.Tensor:
        announce(comm, "broadcast", tensor, detail={**call.detail, "root_rank": root},
                 validate=checks(comm, "broadcast", tensor, root, problem=problem))
        return comm.broadcast(tensor, root)

    return call.submit(task)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values in place."""
    with torch.no_grad():
        return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    return broadcast_async_(tensor.detach().clone().contiguous(), root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send rows ``splits[j]`` of dim 0 to rank ``j`` of the set (even split without ``splits``); differentiable.

    As in Horovod, with ``splits`` given it returns ``(received, received_splits)``.
    """
    call = Call("alltoall", process_set, name)
    out, received = ops.alltoall(call.comm, tensor, None if splits is None else [int(s) for s in splits],
                                 call.detail)
    if splits is None:
        return out
    return out, torch.tensor(received, dtype=torch.int32)


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None, process_set: ProcessSet = global_process_set) -> Handle:
    call = Call("alltoall", process_set, name)
    x = tensor.detach().clone()
    spl = None if splits is None else [int(s) for s in splits]
    return call.submit(lambda: ops.alltoall(call.comm, x, spl, call.detail)[0])


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set reaches this call."""
    call = Call("barrier", process_set, None)
    run_announced(call.comm, "barrier", call.comm.barrier, detail=call.detail, key=call.key)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s object (pickled) on every rank of the set."""
    call = Call("broadcast_object", process_set, name)
    comm = call.comm
    root, problem = set_root(call.ranks, root_rank, "broadcast_object")
    return run_announced(comm, "broadcast_object", lambda: comm.broadcast_object(obj, root), name,
                         detail={**call.detail, "root_rank": root_rank},
                         validate=checks(comm, "broadcast_object", root=root, problem=problem), key=call.key)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's object (pickled), in rank order of the set."""
    call = Call("allgather_object", process_set, name)
    comm = call.comm
    return run_announced(comm, "allgather_object", lambda: comm.allgather_object(obj), name, detail=call.detail,
                         validate=checks(comm, "allgather_object"), key=call.key)
