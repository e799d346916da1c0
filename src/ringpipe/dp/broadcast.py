"""Broadcast model parameters and optimizer state from one rank so that every rank starts equal."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ringpipe.check.announcement import announce, checks
from ringpipe.comm.base import Communicator
from ringpipe.core.engine import Engine

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_tensors"]


def _target(comm: Communicator | None, process_set: Any, root_rank: int,
            what: str) -> tuple[Communicator, int, ValueError | None]:
    """The communicator, the root inside it and a problem with the root: ``comm`` as given, or
    that of ``process_set`` (the global set by default) with the world rank ``root_rank`` translated."""
    if comm is not None:
        return comm, root_rank, None
    from ringpipe.core.process_sets import resolve, set_root

    comm, ranks = resolve(process_set, what)
    root, problem = set_root(ranks, root_rank, what)
    return comm, root, problem


def broadcast_tensors(
    tensors: list[torch.Tensor], root_rank: int, comm: Communicator, announced: bool = False
) -> None:
    """Overwrite ``tensors`` in place with the root's values: one fused broadcast per dtype and device.

    ``announced``: the caller already announced this broadcast (:mod:`ringpipe.check.announcement`).
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    engine = Engine.of(comm)
    if not announced:
        engine.run(lambda: announce(comm, "broadcast", detail={"root_rank": root_rank},
                                    validate=checks(comm, "broadcast", root=root_rank)), name="broadcast-tensors")
    for members in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in members]) if members else None
        if flat is None or flat.numel() == 0:
            continue
        engine.run(functools.partial(comm.broadcast, flat, root_rank), name="broadcast-tensors")
        offset = 0
        with torch.no_grad():
            for t in members:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
    comm: Communicator | None = None,
    process_set: Any = None,
) -> None:
    """Copy ``root_rank``'s parameters (a ``state_dict()`` or ``named_parameters()``) to every rank, in place.

    ``process_set``: only its ranks take part (``root_rank`` is a world rank, as in Horovod).
    """
    comm, root_rank, problem = _target(comm, process_set, root_rank, "broadcast_parameters")
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(t).__name__}, not a tensor")
    layout = [(str(n), tuple(t.shape), str(t.dtype)) for n, t in items]
    engine = Engine.of(comm)
    def gather_layouts() -> list[Any]:
        announce(comm, "broadcast", detail={"root_rank": root_rank, "of": "parameters"},
                 validate=checks(comm, "broadcast_parameters", root=root_rank, problem=problem))
        return comm.allgather_object(layout)

    every = engine.run(gather_layouts, name="broadcast-layout")
    root_layout = every[root_rank]
    for rank, theirs in enumerate(every):
        if theirs == root_layout:
            continue
        diff = next(
            (f"{b} on rank {rank} vs {a} on rank {root_rank}"
             for a, b in zip(root_layout, theirs, strict=False) if a != b),
            f"{len(theirs)} tensors on rank {rank} vs {len(root_layout)} on rank {root_rank}",
        )
        raise ValueError(
            f"broadcast_parameters: rank {rank} does not hold the same tensors as rank {root_rank} ({diff}); "
            "every rank must build the same model before broadcasting"
        )
    broadcast_tensors([t for _, t in items], root_rank, comm, announced=True)


class _TensorRef:
    """Stands for a tensor in a broadcast optimizer state skeleton."""

    __slots__ = ("index", "shape", "dtype", "on_cpu")

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype, on_cpu: bool) -> None:
        self.index, self.shape, self.dtype, self.on_cpu = index, shape, dtype, on_cpu

    def __reduce__(self) -> tuple[Any, ...]:
        return (_TensorRef, (self.index, self.shape, self.dtype, self.on_cpu))


def _strip(obj: Any, out: list[torch.Tensor]) -> Any:
    """Replace tensors by references (collected into ``out``) so the skeleton pickles small."""
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
        return _TensorRef(len(out) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    if isinstance(obj, dict):
        return {k: _strip(v, out) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_strip(v, out) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int = 0,
    comm: Communicator | None = None,
    process_set: Any = None,
    model: Any = None,
    initialize_state: bool = False,
) -> None:
    """Give every rank ``root_rank``'s optimizer state: buffers, step counts, learning rates, all groups.

    Works when only the root has state yet (e.g. after loading a checkpoint there): the other
    ranks replace theirs by the root's. The structure travels as one small object and the
    tensors as fused broadcasts. ``initialize_state``: as Horovod does, first give an optimizer
    without state its state by one local step on zero gradients (the Horovod-style API does;
    note that the step counts, and weight decay moves the weights). ``process_set``: only its
    ranks take part (``root_rank`` is a world rank); ``model`` is accepted for Horovod compatibility.
    """
    comm, root_rank, problem = _target(comm, process_set, root_rank, "broadcast_optimizer_state")
    inner = getattr(optimizer, "optimizer", optimizer)
    if initialize_state and problem is None and not inner.state:
        _initialise_state(inner)
    engine = Engine.of(comm)
    tensors: list[torch.Tensor] = []
    skeleton = _strip(inner.state_dict(), tensors) if comm.rank == root_rank else None
    def send_skeleton() -> Any:
        announce(comm, "broadcast", detail={"root_rank": root_rank, "of": "optimizer state"},
                 validate=checks(comm, "broadcast_optimizer_state", root=root_rank, problem=problem))
        return comm.broadcast_object(skeleton, root_rank)

    skeleton = engine.run(send_skeleton, name="broadcast-optimizer")
    if comm.rank != root_rank:
        refs: list[_TensorRef] = []
        _collect_refs(skeleton, refs)
        device = _state_device(inner)
        tensors = [
            torch.empty(r.shape, dtype=r.dtype, device="cpu" if r.on_cpu else device)
            for r in sorted(refs, key=lambda r: r.index)
        ]
    else:
        tensors = [t.clone() for t in tensors]
    broadcast_tensors(tensors, root_rank, comm, announced=True)
    if comm.rank != root_rank:
        ours = len(inner.param_groups), [len(g["params"]) for g in inner.param_groups]
        theirs = len(skeleton["param_groups"]), [len(g["params"]) for g in skeleton["param_groups"]]
        if ours != theirs:
            raise ValueError(
                f"broadcast_optimizer_state: rank {root_rank} has parameter groups {theirs[1]} but rank "
                f"{comm.rank} has {ours[1]}; build the same optimizer on every rank"
            )
        # Through the wrapper when there is one: DistributedOptimizer re-shares the new state and groups.
        optimizer.load_state_dict(_fill(skeleton, tensors))


def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's state initialisation: zero gradients for every trainable parameter, then one local step."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params:
        return
    for p in params:
        p.grad = torch.zeros_like(p) if not isinstance(optimizer, torch.optim.SparseAdam) else torch.zeros_like(p).to_sparse()
    optimizer.step()


def _collect_refs(obj: Any, out: list[_TensorRef]) -> None:
    if isinstance(obj, _TensorRef):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_refs(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect_refs(v, out)


def _state_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")
