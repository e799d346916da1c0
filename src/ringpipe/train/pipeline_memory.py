"""A pipeline run's memory: the plan made before training, the budget check, the figures of the summary.

:func:`plan_for` predicts every stage's peak for the run's model, split, micro-batch and
optimizer (one process, :func:`ringpipe.pipeline.memory_plan.plan_memory`, on a model built
for the purpose under a forked random state, so the run's own initialisation is untouched);
:func:`refuse_over_budget` turns a ``pipeline.memory_budget`` the plan does not fit into a
:class:`~ringpipe.train.config.ConfigError` on every rank; :func:`memory_summary` gathers the
peak each stage measured (:class:`~ringpipe.pipeline.memory.MemoryMeter`) beside the
prediction for ``summary.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringpipe.comm.base import Communicator
from ringpipe.pipeline.memory import MemoryBudgetError, MemoryMeter, parse_bytes
from ringpipe.pipeline.memory_plan import ScheduleMemory, check_budget, plan_memory
from ringpipe.train.config import ConfigError

__all__ = ["plan_for", "refuse_over_budget", "memory_summary"]


def plan_for(build_model: Callable[[], Any], data: Any, batch_size: int, microbatches: int, stages: int,
             balance: Sequence[int] | Callable[[int], Any] | str, loss_fn: Any, optimizer_factory: Any,
             modes: Sequence[str], chunks: int = 2, recompute: bool = False, step_every: int = 1,
             mitigations: Any = None, split_points: Sequence[str] | None = None) -> list[ScheduleMemory]:
    """The predicted peak per stage of each of ``modes`` for this model and data (see the module docstring).

    An ``nn.Sequential`` (or a list of layers) without ``split_points`` is cut by ``balance``, as a run cuts
    it; any other model
    is traced and cut at ``split_points`` where they give the mode's number of parts, else balanced by
    parameters over that many parts (:func:`ringpipe.pipeline.tracing.split_model`, as a run without
    split points does)."""
    from ringpipe.pipeline.tracing import split_model

    with torch.random.fork_rng(devices=[]):
        model = build_model()
        n = max(1, min(batch_size // microbatches, len(data)))
        x, y = data.batch(torch.arange(n))
        traced = split_points is not None or (isinstance(model, torch.nn.Module)
                                              and not isinstance(model, torch.nn.Sequential))
        if not traced:  # an nn.Sequential or a list of layers, cut by layer counts as the run cuts it
            return plan_memory(model, stages, microbatches, x, y, loss_fn, optimizer_factory, balance=balance,
                               chunks=chunks, recompute=recompute, step_every=step_every,
                               mitigations=mitigations or (), modes=modes)
        sample = data.batch(torch.arange(max(2, min(batch_size, len(data)))))[0]  # tracing needs 2 samples or more

        def split(parts: int) -> list[torch.nn.Module]:
            points = list(split_points) if split_points is not None and len(split_points) + 1 == parts else None
            return list(split_model(model, sample, points, None if points else parts).stages)

        return plan_memory(None, stages, microbatches, x, y, loss_fn, optimizer_factory, chunks=chunks,
                           recompute=recompute, step_every=step_every, mitigations=mitigations or (), modes=modes,
                           split=split)


def refuse_over_budget(plan: ScheduleMemory, budget: str | int | None) -> None:
    """A :class:`ConfigError` (raised on every rank alike) when ``plan`` exceeds ``budget``."""
    if budget is None:
        return
    try:
        check_budget(plan, parse_bytes(budget))
    except MemoryBudgetError as exc:
        raise ConfigError(f"pipeline.memory_budget={budget}: {exc}") from None


def memory_summary(comm: Communicator, stage: int, meter: MemoryMeter | None,
                   plan: ScheduleMemory | None) -> dict[str, Any]:
    """Per stage (one entry per rank), the predicted and the measured peak with their parts (every rank calls)."""
    mine: dict[str, Any] = {"rank": comm.rank, "stage": stage,
                            "measured": meter.peak.as_dict() if meter is not None else None,
                            "predicted": plan.stages[stage].as_dict() if plan is not None and not plan.error else None}
    ranks: list[dict[str, Any]] = comm.allgather_object(mine) if comm.size > 1 else [mine]
    for r in ranks:
        m, p = r["measured"], r["predicted"]
        if m and p and m["peak"]:
            r["error"] = round(p["peak"] / m["peak"] - 1, 4)
    return {"memory": {"per_rank": ranks, "unit": "bytes",
                       "measured_by": "unique tensor storages the stage holds after each action"
                       + (" (gpu_peak: torch.cuda.max_memory_allocated)" if any(
                           r["measured"] and "gpu_peak" in r["measured"] for r in ranks) else "")}}
