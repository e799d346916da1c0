"""Fusion buckets: each parameter's slot in a flat per-dtype buffer, Horovod's groups, and the bucket reducer.

The buffers are built once, at construction of the optimizer; ``param.grad`` becomes a view of
its slot after the first step, so a reduced bucket needs no copy out (as DDP's
``gradient_as_bucket_view``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.core.engine import Handle

__all__ = ["Slot", "Bucket", "make_buckets", "split_tail", "name_parameters", "timed", "bucket_allreduce", "groups_setting", "explicit_groups"]


class Slot:
    """One parameter's place in a bucket."""

    __slots__ = ("param", "name", "bucket", "view", "count", "used", "sparse")

    def __init__(self, param: torch.nn.Parameter, name: str) -> None:
        self.param = param
        self.name = name
        self.bucket: Bucket | None = None
        self.view: torch.Tensor | None = None
        self.count = 0
        self.used = False
        self.sparse = False  # the last gradient came sparse (it is handed back sparse)


class Bucket:
    """A flat buffer holding the gradients of several parameters of one dtype and device."""

    __slots__ = ("index", "slots", "buffer", "numel", "pending", "handle", "wire", "bitmap", "ready")

    def __init__(self, index: int, slots: list[Slot], bitmap: int) -> None:
        self.index = index
        self.slots = slots
        first = slots[0].param
        self.numel = sum(s.param.numel() for s in slots)
        self.bitmap = bitmap  # after the gradients: per parameter, ranks that had a gradient (last bucket)
        self.buffer = torch.zeros(self.numel + bitmap, dtype=first.dtype, device=first.device)
        offset = 0
        for s in slots:
            n = s.param.numel()
            s.view = self.buffer[offset : offset + n].view(s.param.shape)
            s.bucket = self
            offset += n
        self.pending = len(slots)
        self.handle: Handle | None = None
        self.wire: torch.Tensor | None = None
        self.ready = 0.0  # when its last gradient arrived (timed steps only)


def make_buckets(slots: list[Slot], explicit: list[list[Slot]] | None, first_cap: int, cap: int,
                 tail_cap: int = 0) -> list[Bucket]:
    """Group parameters, last registered first, into buckets closed once they reach their cap.

    The first bucket's cap is small (``first_cap``, as DDP's 1 MiB) so that the
    first reduction starts early in backward and overlaps with the rest of it. With
    ``tail_cap``, the parameters whose gradients come last (those of the first registered
    modules, whole modules up to ``tail_cap`` bytes) are split off the last bucket into one of
    their own, so that the rest of it is reduced while backward computes them and only a small
    reduction is left when backward ends. With ``explicit`` groups (Horovod's ``groups``), each
    group of one dtype is one bucket.
    """
    if explicit is not None:
        split: list[list[Slot]] = []
        for group in reversed(explicit):
            by_kind: dict[tuple[torch.dtype, torch.device], list[Slot]] = {}
            for s in reversed(group):
                by_kind.setdefault((s.param.dtype, s.param.device), []).append(s)
            split.extend(by_kind.values())
        last = len(split) - 1
        return [Bucket(i, g, bitmap=len(slots) if i == last else 0) for i, g in enumerate(split)]
    open_: dict[tuple[torch.dtype, torch.device], list[Slot]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    groups: list[list[Slot]] = []
    for s in reversed(slots):  # backward produces the last parameters' gradients first
        key = (s.param.dtype, s.param.device)
        current = open_.get(key)
        if current is None:
            current = []
            groups.append(current)
            open_[key], sizes[key] = current, 0
        current.append(s)
        sizes[key] += s.param.numel() * s.param.element_size()
        limit = first_cap if len(groups) == 1 else cap
        if sizes[key] >= limit:
            del open_[key]
    if tail_cap and len(groups) > 1:
        rest, tail = split_tail(groups[-1], tail_cap)
        if rest:
            groups[-1:] = [rest, tail]
    last = len(groups) - 1
    return [Bucket(i, g, bitmap=len(slots) if i == last else 0) for i, g in enumerate(groups)]


def split_tail(group: list[Slot], cap: int) -> tuple[list[Slot], list[Slot]]:
    """The parameters at the end of ``group``, whole modules up to ``cap`` bytes (the tail), and the rest.

    A module's parameters get their gradients from one step of backward, together; a module is
    told by the parameter's name without its last part (``layer.0`` of ``layer.0.weight``).
    """
    i, size = len(group), 0
    while i > 0 and size < cap:
        module = group[i - 1].name.rpartition(".")[0]
        while i > 0 and group[i - 1].name.rpartition(".")[0] == module:
            size += group[i - 1].param.numel() * group[i - 1].param.element_size()
            i -= 1
    return group[:i], group[i:]


def name_parameters(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
) -> list[tuple[str, torch.nn.Parameter]]:
    """The optimizer's parameters with names, in registration order."""
    in_groups = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(in_groups)]
    named = list(named_parameters)
    names = [n for n, _ in named]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"named_parameters has duplicate names {dupes}; give every parameter a unique name")
    known = {id(p) for _, p in named}
    unnamed = [i for i, p in enumerate(in_groups) if id(p) not in known]
    if unnamed:
        raise ValueError(
            f"{len(unnamed)} optimizer parameters (positions {unnamed[:5]}) are missing from named_parameters; "
            "pass model.named_parameters() of the model whose parameters the optimizer holds"
        )
    wanted = {id(p) for p in in_groups}
    return [(n, p) for n, p in named if id(p) in wanted]  # type: ignore[misc]


def timed(clock: dict[str, float], bucket: Bucket, task: Callable[[], Any],
           then: Callable[[Any], None]) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """``task`` and ``then`` that add their durations to ``clock`` (see ``DistributedOptimizer.clock``)."""

    def timed_task() -> Any:
        t0 = time.perf_counter()
        if bucket.ready:
            clock["ready_to_sent"] = clock.get("ready_to_sent", 0.0) + t0 - bucket.ready
            bucket.ready = 0.0
        out = task()
        clock["engine"] = clock.get("engine", 0.0) + time.perf_counter() - t0
        return out

    def timed_then(value: Any) -> None:
        t0 = time.perf_counter()
        then(value)
        clock["copy_out"] = clock.get("copy_out", 0.0) + time.perf_counter() - t0

    return timed_task, timed_then


def bucket_allreduce(comm: Communicator, algorithm: str) -> Callable[[torch.Tensor], Any]:
    """The sum-allreduce used for buckets: returns a Work (native) or the reduced tensor."""
    if algorithm == "native":
        return lambda t: comm.iallreduce(t, ReduceOp.SUM)
    try:
        from ringpipe import collectives
    except ImportError:
        raise ValueError(
            f"algorithm={algorithm!r} needs ringpipe.collectives, which is not available in this installation; "
            "use algorithm='native'"
        ) from None
    valid = tuple(getattr(collectives, "SUPPORTED", {}).get("allreduce", getattr(collectives, "ALGORITHMS", ())))
    valid = tuple(a for a in valid if a != "native")
    if algorithm not in valid:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; valid: native, {', '.join(valid)}")

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = collectives.allreduce(comm, t, ReduceOp.SUM, algorithm=algorithm)
        if isinstance(out, torch.Tensor) and out is not t:
            t.copy_(out)
        return t

    return reduce


def groups_setting(optimizer: torch.optim.Optimizer, groups: Any) -> Any:
    """``groups`` as a value every rank can compare: an integer, or the parameters' positions."""
    if groups is None or isinstance(groups, bool):
        return groups if groups is None else repr(groups)
    if isinstance(groups, int):
        return groups
    if not isinstance(groups, list):
        return f"invalid: {type(groups).__name__}"
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return [[index.get(id(p), -1) if isinstance(p, torch.Tensor) else repr(p) for p in g] for g in groups]


def explicit_groups(groups: Any, slots: list[Slot]) -> list[list[Slot]] | None:
    """Horovod's ``groups``: validated, as lists of slots (parameters outside any group alone)."""
    if groups is None:
        return None
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, int):
        n = min(groups, len(slots)) or 1
        d, r = divmod(len(slots), n)  # Horovod's split_list: n nearly even runs in registration order
        return [slots[i * d + min(i, r) : (i + 1) * d + min(i + 1, r)] for i in range(n)]
    by_id = {id(s.param): s for s in slots}
    seen: set[int] = set()
    out = []
    for group in groups:
        if not isinstance(group, (list, tuple)) or any(not isinstance(p, torch.Tensor) for p in group):
            raise ValueError("groups must consist of torch.Tensor.")
        for p in group:
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))
        members = [by_id[id(p)] for p in group if id(p) in by_id]
        if members:
            out.append(members)
    out.extend([s] for s in slots if id(s.param) not in seen)
    return out
