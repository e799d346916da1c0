"""The Horovod-style top-level API: ``import ringpipe as hvd`` runs a ``horovod.torch`` script.

The naming grid follows Horovod: ``op`` returns a new tensor (differentiable), ``op_`` works in
place, ``op_async`` / ``op_async_`` return a :class:`~ringpipe.dp.engine.Handle` to pass to
``synchronize(handle)`` (which returns the result) or ``poll(handle)``. The process state (the
world communicator and its engine) lives in one :class:`World` object created by :func:`init`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.dp import ops
from ringpipe.dp.announce import JoinError, announce, finish, run_announced, wire_op
from ringpipe.dp.broadcast import broadcast_optimizer_state, broadcast_parameters
from ringpipe.dp.checkpoint import load_checkpoint, save_checkpoint
from ringpipe.dp.compression import Compression
from ringpipe.dp.engine import Engine, Handle
from ringpipe.dp.join import join as _join
from ringpipe.dp.lr import GradualWarmup, scale_lr
from ringpipe.dp.optimizer import DistributedOptimizer
from ringpipe.dp.sampler import DistributedSampler
from ringpipe.dp.sync_batchnorm import SyncBatchNorm

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "DistributedSampler",
    "GradualWarmup",
    "Handle",
    "JoinError",
    "Max",
    "Min",
    "NotInitializedError",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "World",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "communicator",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_initialized",
    "join",
    "load_checkpoint",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "rocm_built",
    "save_checkpoint",
    "scale_lr",
    "shutdown",
    "size",
    "synchronize",
]

log = logging.getLogger(__name__)

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


class NotInitializedError(ValueError):
    """An API call was made before :func:`init` (or after :func:`shutdown`)."""


class World:
    """The process state of the API: the world communicator and its background engine."""

    def __init__(self, comm: Communicator, owns_comm: bool) -> None:
        self.comm = comm
        self.engine = Engine.of(comm)
        self.owns_comm = owns_comm

    def close(self) -> None:
        self.engine.shutdown()
        if self.owns_comm and self.comm.backend != "mpi":
            from ringpipe.comm.world import shutdown_world

            shutdown_world()


_state: World | None = None


def _world() -> World:
    if _state is None:
        raise NotInitializedError("ringpipe has not been initialised: call ringpipe.init() first")
    return _state


# ----------------------------------------------------------------------------- lifecycle


def init(comm: Communicator | None = None, backend: str | None = None) -> None:
    """Initialise ringpipe (Horovod step 1): from the launch environment, or around an existing ``comm``.

    The backend is ``backend``, else ``$RINGPIPE_BACKEND``, else NCCL with GPUs and gloo without.
    Calling ``init`` again while initialised does nothing.
    """
    global _state
    if _state is not None:
        if comm is not None and comm is not _state.comm:
            raise RuntimeError("ringpipe is already initialised with another communicator; call shutdown() first")
        return
    if comm is None:
        from ringpipe.comm.world import init_world

        comm = init_world(backend or os.environ.get("RINGPIPE_BACKEND") or None)
        _state = World(comm, owns_comm=True)
    else:
        _state = World(comm, owns_comm=False)
    log.debug("ringpipe initialised: %r", comm)


def shutdown() -> None:
    """Stop the engine and release the communicator created by :func:`init` (or by ``init_world``).

    With ``RINGPIPE_TIMELINE=FILE`` in the environment (as ``HOROVOD_TIMELINE`` in Horovod), rank 0
    first writes a Chrome timeline of every rank's communication to ``FILE`` and the events beside it
    (``FILE`` with ``.events.json``, for ``ringpipe doctor`` and ``ringpipe trace``).
    """
    global _state
    if _state is None:  # a world from init_world() (the lower-level entry point) is released too
        from ringpipe.comm.world import shutdown_world

        shutdown_world()
        return
    state, _state = _state, None
    path = os.environ.get("RINGPIPE_TIMELINE")
    try:
        if path:
            state.engine.run(lambda: _write_timeline(state.comm, path), name="timeline")
    finally:
        state.close()


def _write_timeline(comm: Communicator, path: str) -> None:
    from pathlib import Path

    from ringpipe.observe import collect_events, save_events, write_timeline

    job = collect_events(comm)
    if job is not None:
        out = write_timeline(path, job)
        save_events(out.with_name(out.stem + ".events.json"), job)
        log.info("timeline written to %s (open in chrome://tracing or ui.perfetto.dev)", Path(path))


def is_initialized() -> bool:
    return _state is not None


def communicator() -> Communicator:
    """The world communicator (for ringpipe's lower layers)."""
    return _world().comm


def rank() -> int:
    return _world().comm.rank


def size() -> int:
    return _world().comm.size


def local_rank() -> int:
    return _world().comm.topology.local_rank


def local_size() -> int:
    return _world().comm.topology.local_size


def cross_rank() -> int:
    """The index of this rank's node."""
    return _world().comm.topology.node_rank


def cross_size() -> int:
    """The number of nodes."""
    return _world().comm.topology.num_nodes


def mpi_enabled() -> bool:
    return _world().comm.backend == "mpi"


def gloo_enabled() -> bool:
    return _world().comm.backend == "gloo"


def mpi_built() -> bool:
    from ringpipe.comm.mpi_backend import mpi_available

    return mpi_available()


def gloo_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def nccl_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_nccl_available()


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return torch.version.hip is not None


def mpi_threads_supported() -> bool:
    """Only the engine thread calls MPI, so ringpipe needs no MPI thread support."""
    return False


# ----------------------------------------------------------------------------- handles


def poll(handle: Handle) -> bool:
    """Whether the asynchronous operation behind ``handle`` has finished (never blocks)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its result."""
    return handle.wait()


def _parse(op: ReduceOp | str | None, average: bool | None) -> ReduceOp:
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.parse(op if op is not None else ReduceOp.AVERAGE)


# ----------------------------------------------------------------------------- allreduce


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` over ranks into a new tensor (Average by default); differentiable."""
    comp = Compression.parse(compression)
    wire, ctx = comp.compress(tensor)
    out = ops.allreduce(_world().comm, wire, _parse(op, average), prescale_factor, postscale_factor)
    return comp.decompress(out, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` over ranks in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor))


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor`` once reduced."""
    world = _world()
    comm, rop = world.comm, _parse(op, average)
    if not tensor.is_contiguous():
        raise ValueError("allreduce_async_: the tensor must be contiguous for an in-place reduction")

    notes = []

    def task() -> Any:
        notes.append(announce(comm, "allreduce", tensor, rop))
        if prescale_factor != 1.0:
            tensor.mul_(prescale_factor)
        return comm.iallreduce(tensor, wire_op(rop, notes[0]))

    def then(out: torch.Tensor) -> torch.Tensor:
        finish(tensor, rop, notes[0])
        if postscale_factor != 1.0:
            tensor.mul_(postscale_factor)
        return tensor

    return world.engine.submit(task, then, name=name or "allreduce")


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start an allreduce into a new tensor; ``synchronize(handle)`` returns it."""
    return allreduce_async_(tensor.detach().clone().contiguous(), average, name, op, prescale_factor, postscale_factor)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Reduce several tensors in place as one fused message; ``synchronize`` returns the list."""
    world = _world()
    comm, rop = world.comm, _parse(op, average)
    items = list(tensors)
    if not items:
        return world.engine.submit(lambda: [], name=name or "grouped_allreduce")
    dtypes = {(t.dtype, t.device) for t in items}
    if len(dtypes) != 1:
        raise ValueError(f"grouped_allreduce needs tensors of one dtype and device, got {sorted(map(str, dtypes))}")
    flat = torch.cat([t.detach().reshape(-1) for t in items])

    notes = []

    def task() -> Any:
        notes.append(announce(comm, "allreduce", flat, rop))
        if prescale_factor != 1.0:
            flat.mul_(prescale_factor)
        return comm.iallreduce(flat, wire_op(rop, notes[0]))

    def then(out: torch.Tensor) -> list[torch.Tensor]:
        finish(flat, rop, notes[0])
        if postscale_factor != 1.0:
            flat.mul_(postscale_factor)
        offset = 0
        with torch.no_grad():
            for t in items:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return items

    return world.engine.submit(task, then, name=name or "grouped_allreduce")


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> Handle:
    copies = [t.detach().clone() for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: ReduceOp | str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce several tensors (differentiable, one collective per tensor)."""
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor) for t in tensors]


# ----------------------------------------------------------------------------- other collectives


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ); differentiable."""
    return ops.allgather(_world().comm, tensor)


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> Handle:
    world = _world()
    comm, x = world.comm, tensor.detach().clone().contiguous()

    def then(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts) if x.dim() == 0 else torch.cat(parts, 0)

    def task() -> list[torch.Tensor]:
        announce(comm, "allgather")
        return comm.allgather(x)

    return world.engine.submit(task, then, name=name or "allgather")


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """A new tensor with ``root_rank``'s values; differentiable."""
    return ops.broadcast(_world().comm, tensor, root_rank)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Handle:
    world = _world()
    comm = world.comm
    def task() -> torch.Tensor:
        announce(comm, "broadcast")
        return comm.broadcast(tensor, root_rank)

    return world.engine.submit(task, name=name or "broadcast")


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values in place."""
    with torch.no_grad():
        return synchronize(broadcast_async_(tensor, root_rank, name))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Handle:
    return broadcast_async_(tensor.detach().clone().contiguous(), root_rank, name)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: ReduceOp | str | None = None) -> torch.Tensor:
    """Reduce over ranks and keep this rank's block of dim 0 (Average by default); differentiable."""
    comp = Compression.parse(compression)
    wire, ctx = comp.compress(tensor)
    return comp.decompress(ops.reducescatter(_world().comm, wire, _parse(op, None)), ctx)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | str | None = None) -> Handle:
    world = _world()
    comm, rop, x = world.comm, _parse(op, None), tensor.detach().clone()
    return world.engine.submit(lambda: ops.reducescatter_blocks(comm, x, rop), name=name or "reducescatter")


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send rows ``splits[j]`` of dim 0 to rank ``j`` (even split without ``splits``); differentiable.

    As in Horovod, with ``splits`` given it returns ``(received, received_splits)``.
    """
    out, received = ops.alltoall(_world().comm, tensor, None if splits is None else list(map(int, splits)))
    if splits is None:
        return out
    return out, torch.tensor(received, dtype=torch.int32)


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None) -> Handle:
    world = _world()
    comm, x = world.comm, tensor.detach().clone()
    spl = None if splits is None else [int(s) for s in splits]
    return world.engine.submit(lambda: ops.alltoall(comm, x, spl)[0], name=name or "alltoall")


def barrier() -> None:
    world = _world()
    run_announced(world.comm, "barrier", world.comm.barrier)


def join(device: int = -1) -> int:
    """Wait for every rank to run out of data; returns the last rank to join.

    Meanwhile this rank serves the others' optimizer steps (with their learning rate), their
    allreduces (SyncBatchNorm, metrics: it contributes the identity of the op, so an Average
    is over the ranks with data) and barriers; any other collective raises :class:`JoinError`
    on every rank. ``device`` is accepted for Horovod compatibility and not used.
    """
    return _join(_world().comm)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    world = _world()
    return run_announced(world.comm, "broadcast_object", lambda: world.comm.broadcast_object(obj, root_rank), name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    world = _world()
    return run_announced(world.comm, "allgather_object", lambda: world.comm.allgather_object(obj), name)
