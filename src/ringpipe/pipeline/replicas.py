"""Data parallelism across pipeline replicas: the rank grid and gradient averaging per stage.

With ``world = stages x replicas`` ranks, replica ``r`` is the contiguous pipeline of ranks
``r*stages .. r*stages + stages - 1`` (neighbour stages are neighbour ranks, usually on the same
node), and stage ``s``'s replicas ``s, s + stages, ...`` form one data-parallel group whose
gradients are averaged before every optimizer step, on that group's data-parallel engine
thread (:class:`ringpipe.core.engine.Engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ringpipe.comm.base import Communicator
from ringpipe.core.engine import Engine

__all__ = ["PipelineGrid", "TiedGroup", "make_grid", "replica_group", "average_gradients", "tied_groups", "sum_tied_gradients"]


@dataclass(frozen=True)
class PipelineGrid:
    """Where a rank sits: its stage, its replica, and its pipeline neighbours (world ranks)."""

    num_stages: int
    replicas: int
    rank: int

    @property
    def stage(self) -> int:
        return self.rank % self.num_stages

    @property
    def replica(self) -> int:
        return self.rank // self.num_stages

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.num_stages + stage

    @property
    def prev_rank(self) -> int | None:
        return None if self.stage == 0 else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        return None if self.stage == self.num_stages - 1 else self.rank + 1

    @property
    def last_stage_rank(self) -> int:
        return self.rank_of(self.num_stages - 1, self.replica)

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, r) for r in range(self.replicas)]


class TiedGroup(NamedTuple):
    """Weights tied across stages as one rank holds them: its copies, the holders' communicator
    (one pipeline replica; member ``i`` holds stage ``stages[i]``) and the holding stages, ascending."""

    params: list[torch.nn.Parameter]
    comm: Communicator
    stages: tuple[int, ...]


def make_grid(world_size: int, rank: int, num_stages: int, replicas: int = 1) -> PipelineGrid:
    """The grid of a world of ``world_size`` ranks, refusing sizes that do not fit."""
    if num_stages < 1 or replicas < 1:
        raise ValueError(f"stages ({num_stages}) and replicas ({replicas}) must be >= 1")
    if num_stages * replicas > world_size:
        raise ValueError(
            f"{num_stages} stages x {replicas} replicas need {num_stages * replicas} ranks but the world "
            f"has {world_size}; use fewer stages or replicas, or start more processes"
        )
    if num_stages * replicas != world_size:
        raise ValueError(
            f"{num_stages} stages x {replicas} replicas = {num_stages * replicas} ranks, but the world has "
            f"{world_size}; every rank must hold a stage (set replicas = {world_size // num_stages} "
            f"or start {num_stages * replicas} processes)"
        )
    return PipelineGrid(num_stages, replicas, rank)


def replica_group(comm: Communicator, grid: PipelineGrid) -> Communicator | None:
    """This stage's data-parallel group (``None`` without replicas). Collective over ``comm``."""
    if grid.replicas == 1:
        return None
    mine = None
    for s in range(grid.num_stages):
        sub = comm.split(grid.stage_ranks(s), name=f"{comm.name}/stage{s}")
        if s == grid.stage:
            mine = sub
    return mine


def _reduce_gradients(params: Sequence[torch.nn.Parameter], comm: Communicator, op: str, name: str) -> None:
    """Reduce ``p.grad`` over ``comm`` with ``op`` in one flat message (missing gradients count as zeros)."""
    if comm.size == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    Engine.of(comm).run(lambda: comm.allreduce(flat, op), name=name)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        part = flat[offset : offset + g.numel()].view_as(g)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.copy_(part)
        offset += g.numel()


def average_gradients(params: Sequence[torch.nn.Parameter], comm: Communicator) -> None:
    """Average ``p.grad`` over ``comm`` in one flat message (missing gradients count as zeros)."""
    _reduce_gradients(params, comm, "average", "pipeline-replica-grads")


def sum_tied_gradients(tied: Sequence[TiedGroup]) -> None:
    """Sum the gradients of weights tied across stages over the ranks holding a copy (synchronous schedules).

    ``tied``: for each group of stages sharing weights, this rank's copies of them and the
    communicator of the ranks holding them (one pipeline replica). After the sum every copy
    steps with the gradient one module holding the weight once would have (the sum of its uses),
    so the copies stay equal. Missing gradients count as zeros. The asynchronous pipeline uses
    another rule (:mod:`ringpipe.pipeline.tied_owner`).
    """
    for group in tied:
        _reduce_gradients(group.params, group.comm, "sum", "pipeline-tied-grads")


def tied_groups(
    comm: Communicator,
    grid: PipelineGrid,
    holders: Sequence[tuple[torch.nn.Parameter, Sequence[int]]],
) -> list[TiedGroup]:
    """The groups of tied weights this rank holds. Collective over ``comm`` (every rank, same ``holders``).

    ``holders``: each tied weight (this rank's object, which every rank builds alike) and the
    stages holding a copy. Weights held by the same stages share one communicator per replica.
    """
    by_stages: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for param, stages in holders:
        key = tuple(sorted(set(stages)))
        if len(key) > 1:
            by_stages.setdefault(key, []).append(param)
    out = []
    for key in sorted(by_stages):
        for replica in range(grid.replicas):
            ranks = [grid.rank_of(s, replica) for s in key]
            sub = comm.split(ranks, name=f"{comm.name}/tied{'-'.join(map(str, key))}r{replica}")
            if sub is not None and grid.stage in key and replica == grid.replica:
                out.append(TiedGroup(by_stages[key], sub, key))
    return out
