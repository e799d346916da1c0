"""Every schedule's peak memory per stage for one model, predicted in one process before a run.

:func:`plan_memory` splits the layers as a pipeline run would (per schedule: interleaving
cuts the model into ``stages x chunks`` parts), runs one micro-batch through the parts to
measure what each leaves (:func:`ringpipe.pipeline.memory.microbatch_footprint`), measures
each rank's optimizer state with one step on copies, and walks each schedule's action lists
(:func:`ringpipe.pipeline.memory.predict_stage`). :func:`format_plan` prints the schedules
side by side; :func:`check_budget` refuses a schedule whose peak does not fit a budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringpipe.pipeline.memory import (
    MemoryBudgetError,
    MicrobatchFootprint,
    StageMemory,
    format_bytes,
    microbatch_footprint,
    optimizer_state_bytes,
    predict_stage,
    stash_kind,
)
from ringpipe.pipeline.partition import as_layers, partition
from ringpipe.pipeline.schedules import async_1f1b, gpipe, one_f_one_b, seq
from ringpipe.pipeline.schedules_interleaved import interleaved_1f1b
from ringpipe.pipeline.zero_bubble import zb_h1, zb_h2

__all__ = ["MODES", "ScheduleMemory", "plan_memory", "format_plan", "check_budget", "mode_actions"]

#: The pipeline modes of ``ringpipe train``, in the order a plan prints them.
MODES = ("seq", "gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "async")


@dataclass
class ScheduleMemory:
    """One mode's predicted peak per stage, or why it cannot run (``error``)."""

    mode: str
    stages: list[StageMemory]
    error: str = ""

    @property
    def peak(self) -> int:
        """The largest stage's peak."""
        return max((s.peak for s in self.stages), default=0)


def mode_actions(mode: str, stages: int, microbatches: int, stage: int, chunks: int = 2,
                 step_every: int = 1) -> list[Any]:
    """A mode's action list for one stage; ``async`` is a stream of ``max(2 m, 2 stages)`` micro-batches."""
    if mode == "seq":
        return seq(stages, microbatches, stage)
    if mode == "gpipe":
        return gpipe(stages, microbatches, stage)
    if mode == "1f1b":
        return one_f_one_b(stages, microbatches, stage)
    if mode == "interleaved":
        return interleaved_1f1b(stages, microbatches, stage, chunks)
    if mode == "zb_h1":
        return zb_h1(stages, microbatches, stage)
    if mode == "zb_h2":
        return zb_h2(stages, microbatches, stage)
    if mode == "async":
        return async_1f1b(stages, max(2 * microbatches, 2 * stages), stage, step_every)
    raise ValueError(f"unknown pipeline mode {mode!r}; modes: {', '.join(MODES)}")


def _footprints(parts: Sequence[nn.Module], x: Any, target: Any, loss_fn: Any) -> list[MicrobatchFootprint]:
    out: list[MicrobatchFootprint] = []
    value: Any = x
    for g, part in enumerate(parts):
        last = g == len(parts) - 1
        fp, value = microbatch_footprint(part, value, g == 0, loss_fn if last else None, target if last else None)
        out.append(fp)
    return out


def plan_memory(
    layers: nn.Sequential | Sequence[nn.Module] | None,
    stages: int,
    microbatches: int,
    microbatch: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    balance: Callable[[int], Sequence[int] | str] | Sequence[int] | str | None = "params",
    chunks: int = 2,
    recompute: bool = False,
    step_every: int = 1,
    mitigations: Any = "ws",
    modes: Sequence[str] = MODES,
    split: Callable[[int], Sequence[nn.Module]] | None = None,
) -> list[ScheduleMemory]:
    """Each mode's predicted peak memory per stage (see the module docstring).

    ``microbatch`` and ``target``: one micro-batch's inputs and targets; ``balance``: layer
    counts, ``"params"``, ``"time"``, or a function of the number of parts giving one of them;
    ``mitigations``: the asynchronous mode's (weight stashing keeps copies). ``split``: instead
    of ``layers`` and ``balance``, the model's parts for a number of parts (a model of any
    shape, traced: :func:`ringpipe.pipeline.tracing.split_model`'s stages).
    """
    if split is None and layers is None:
        raise ValueError("give the layers to split, or split= (the model's parts for a number of parts)")
    all_layers = as_layers(layers) if layers is not None and split is None else []
    splits: dict[int, tuple[list[nn.Module], list[MicrobatchFootprint]]] = {}
    out: list[ScheduleMemory] = []
    for mode in modes:
        k = chunks if mode == "interleaved" else 1
        parts_n = stages * k
        try:
            if parts_n not in splits:
                if split is not None:
                    parts: list[nn.Module] = list(split(parts_n))
                else:
                    bal = balance(parts_n) if callable(balance) else balance
                    parts = list(partition(all_layers, parts_n, bal, microbatch)[0])
                splits[parts_n] = (parts, _footprints(parts, microbatch, target, loss_fn))
            parts, fps = splits[parts_n]
            per_stage = []
            stash = stash_kind(mitigations) if mode == "async" else None
            for s in range(stages):
                mine = [parts[c * stages + s] for c in range(k)]
                params = [p for m in mine for p in m.parameters() if p.requires_grad]
                pbytes = sum(p.numel() * p.element_size() for p in params)
                obytes = optimizer_state_bytes(optimizer_factory, params)
                acts = mode_actions(mode, stages, microbatches, s, chunks, step_every)
                per_stage.append(predict_stage(acts, {c: fps[c * stages + s] for c in range(k)}, pbytes, obytes,
                                               recompute=recompute, stash=stash,
                                               batch_input=microbatches if s == 0 else 0))
            out.append(ScheduleMemory(mode, per_stage))
        except (ValueError, RuntimeError) as exc:
            out.append(ScheduleMemory(mode, [], str(exc).split(";")[0]))
    return out


def format_plan(plans: Sequence[ScheduleMemory], budget: int | None = None) -> str:
    """The modes side by side: per stage the peak (activations held / micro-batches in flight)."""
    stages = max((len(p.stages) for p in plans), default=0)
    head = ["mode", *[f"stage {s} peak" for s in range(stages)], "activations (in flight) per stage",
            "params+grads+opt", "stashes"]
    rows = [head]
    for p in plans:
        if p.error:
            rows.append([p.mode, *["-"] * stages, f"cannot run: {p.error}", "", ""])
            continue
        rows.append([
            p.mode,
            *[format_bytes(s.peak) + (" > budget" if budget is not None and s.peak > budget else "") for s in p.stages],
            ", ".join(f"{format_bytes(s.activations)} ({s.in_flight})" for s in p.stages),
            ", ".join(format_bytes(s.params + s.grads + s.optimizer) for s in p.stages),
            ", ".join(format_bytes(s.stashes) for s in p.stages),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def check_budget(plan: ScheduleMemory, budget: int) -> None:
    """Raise :class:`MemoryBudgetError` with the figures when a stage's predicted peak exceeds ``budget`` bytes."""
    over = [(s, m) for s, m in enumerate(plan.stages) if m.peak > budget]
    if not over:
        return
    detail = "; ".join(
        f"stage {s}: {format_bytes(m.peak)} (activations {format_bytes(m.activations)} for {m.in_flight} "
        f"micro-batches in flight, parameters {format_bytes(m.params)}, gradients {format_bytes(m.grads)}, "
        f"optimizer state {format_bytes(m.optimizer)}, stashes {format_bytes(m.stashes)})"
        for s, m in over
    )
    raise MemoryBudgetError(
        f"mode {plan.mode!r} is predicted to need more than the memory budget of {format_bytes(budget)} per stage: "
        f"{detail}; use fewer micro-batches in flight (1f1b or zb_h1 instead of gpipe or zb_h2), "
        "pipeline.recompute=true, more stages, or a larger pipeline.memory_budget (`ringpipe plan` compares them)"
    )
