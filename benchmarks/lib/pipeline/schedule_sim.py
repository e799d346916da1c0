"""Idle time a pipeline schedule implies, computed from its action lists alone (no processes, no tensors).

Every rank runs its list of actions in order; an action starts when its rank is free and the
actions it depends on have finished: the forward of chunk ``c`` needs chunk ``c-1``'s forward
of the same micro-batch, a backward (``B``, or the input-gradient half ``I``) needs chunk
``c+1``'s backward or input-gradient pass and the chunk's own forward, a weight-gradient pass
``W`` needs the chunk's ``I``. Transfers take no time. Costs are in units of one whole-stage
forward: a forward of a chunk holding a share ``s`` of its rank's layers costs ``s``, a full
backward ``2s``, ``I`` and ``W`` ``s`` each (the usual ``B = 2F`` of dense layers), optimizer
steps nothing. The bubble fraction is the share of ``ranks x makespan`` no rank computes.

Both ringpipe's schedules (``F``/``B``/``S`` lists per stage) and torch.distributed.pipelining's
(``pipeline_order``: per rank, ``(stage_index, type, microbatch)``) are given to the same model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Op", "Timing", "simulate", "ringpipe_ops", "torch_ops"]

COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "S": 0.0}


@dataclass(frozen=True)
class Op:
    """One compute action: ``kind`` F, B, I or W of micro-batch ``mb`` on model chunk ``chunk``."""

    chunk: int
    kind: str
    mb: int


@dataclass(frozen=True)
class Timing:
    makespan: float
    busy: float
    ranks: int

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy / (self.ranks * self.makespan)


def simulate(per_rank: Mapping[int, Sequence[Op]], num_chunks: int, chunks_per_rank: int = 1,
             latency: float = 0.0, step: float = 0.0, backward: float = 2.0,
             costs: Mapping[tuple[int, str], float] | None = None) -> Timing:
    """List-schedule every rank's ops under the dependencies above; the makespan and busy time.

    ``latency``: added to every dependency on another rank's action (a message); ``step``: the
    cost of an optimizer step ``S`` (ops of kind ``S``, chunk -1); ``backward``: the cost of a
    full ``B`` (``I`` and ``W`` cost half of it each). Units: one stage forward of a micro-batch.
    ``costs``: measured cost of each ``(chunk, kind)`` (any unit), replacing the model above for
    the ops it names; a missing ``B`` is taken as ``I + W`` and a missing ``I`` or ``W`` as half
    the chunk's ``B``, when those were measured.
    """
    share = 1.0 / chunks_per_rank
    cost_of = {"F": 1.0, "B": backward, "I": backward / 2, "W": backward / 2, "S": step}
    done: dict[tuple[int, str, int], float] = {}
    pos = {r: 0 for r in per_rank}
    free = {r: 0.0 for r in per_rank}
    busy = 0.0
    total = sum(len(v) for v in per_rank.values())
    owner = {op.chunk: r for r, ops in per_rank.items() for op in ops}
    while len(done) < total:
        progress = False
        for r, ops in per_rank.items():
            while pos[r] < len(ops):
                op = ops[pos[r]]
                deps = _deps(op, num_chunks) if op.kind != "S" else []
                if any(all(d not in done for d in alt) for alt in deps):
                    break
                start = max([free[r]] + [min(done[d] + (latency if owner[d[0]] != r else 0.0)
                                             for d in alt if d in done) for alt in deps])
                cost = _measured(costs, op) if costs else None
                if cost is None:
                    cost = cost_of[op.kind] * (share if op.kind != "S" else 1.0)
                free[r] = start + cost
                busy += cost
                done[(op.chunk if op.kind != "S" else -1 - r, op.kind, op.mb if op.kind != "S" else pos[r])] = free[r]
                pos[r] += 1
                progress = True
        if not progress:
            stuck = {r: ops[pos[r]] for r, ops in per_rank.items() if pos[r] < len(ops)}
            raise ValueError(f"the schedule deadlocks at {stuck}")
    return Timing(max(free.values()), busy, len(per_rank))


def _measured(costs: Mapping[tuple[int, str], float], op: Op) -> float | None:
    c, k = op.chunk, op.kind
    if (c, k) in costs:
        return costs[(c, k)]
    if k == "B" and (c, "I") in costs and (c, "W") in costs:
        return costs[(c, "I")] + costs[(c, "W")]
    if k in ("I", "W") and (c, "B") in costs:
        return costs[(c, "B")] / 2
    return None


def _deps(op: Op, num_chunks: int) -> list[tuple[tuple[int, str, int], ...]]:
    """Groups of alternatives: each group needs one of its actions done."""
    c, m = op.chunk, op.mb
    if op.kind == "F":
        return [((c - 1, "F", m),)] if c > 0 else []
    if op.kind == "W":
        return [((c, "I", m),)]
    out = [((c, "F", m),)]
    if c < num_chunks - 1:
        out.append(((c + 1, "B", m), (c + 1, "I", m)))
    return out


def ringpipe_ops(actions_per_stage: Sequence[Sequence[object]], steps: bool = False) -> dict[int, list[Op]]:
    """ringpipe's per-stage action lists as ops.

    A rank's chunk ``c`` holds part ``c * stages + stage`` of the model (interleaved 1F1B);
    in a list with ``W`` actions, ``B`` is the input-gradient half only (``I`` here).
    """
    n = len(actions_per_stage)
    out: dict[int, list[Op]] = {}
    for s, acts in enumerate(actions_per_stage):
        split = any(a.kind == "W" for a in acts)  # type: ignore[attr-defined]
        out[s] = [
            Op(getattr(a, "chunk", 0) * n + s, "I" if split and a.kind == "B" else a.kind, a.mb)  # type: ignore[attr-defined]
            for a in acts if steps or a.kind != "S"  # type: ignore[attr-defined]
        ]
    return out


def torch_ops(pipeline_order: Mapping[int, Sequence[object]]) -> dict[int, list[Op]]:
    """torch's ``pipeline_order`` (per rank, actions or None) as ops; communication actions dropped."""
    out: dict[int, list[Op]] = {}
    for r, acts in pipeline_order.items():
        ops = []
        for a in acts:
            if a is None:
                continue
            kind = str(getattr(a.computation_type, "value", a.computation_type))  # type: ignore[attr-defined]
            if kind in COST:
                ops.append(Op(a.stage_index, kind, a.microbatch_index))  # type: ignore[attr-defined]
        out[r] = ops
    return out
