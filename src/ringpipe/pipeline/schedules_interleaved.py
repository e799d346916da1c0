"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2.2) as data: several model chunks per rank.

The model is cut into ``stages x chunks`` parts; rank ``r`` holds parts ``r, r + stages,
r + 2 * stages, ...`` (its chunks ``0, 1, ...``), so a micro-batch passes every rank ``chunks``
times. Each part is ``1/chunks`` of a rank's layers, and the pipeline fills and drains in
``1/chunks`` of the time: the bubble of 1F1B, ``(stages - 1) / microbatches`` of the ideal
time, shrinks to ``(stages - 1) / (chunks * microbatches)``, for ``chunks`` times as many
messages.

Order on rank ``r`` (the paper's, as Megatron-LM runs it): the rank sees ``microbatches x
chunks`` forward "virtual micro-batches" ``k = 0, 1, ...``; forward ``k`` is on chunk
``(k // stages) % chunks`` for micro-batch ``(k // (stages * chunks)) * stages + k % stages``
(groups of ``stages`` micro-batches go through chunk 0, then the same group through chunk 1,
...); backward ``k`` walks the chunks in reverse. ``2 * (stages - r - 1) + (chunks - 1) *
stages`` warm-up forwards, then one forward / one backward, then the remaining backwards and
one step. ``microbatches`` must be a multiple of ``stages``.
"""

from __future__ import annotations

from ringpipe.pipeline.actions import Action, ScheduleError, check_args

__all__ = ["interleaved_1f1b", "chunk_of_part", "part_of_chunk"]


def part_of_chunk(num_stages: int, stage: int, chunk: int) -> int:
    """Which part of the model (virtual stage) a rank's chunk holds: ``chunk * stages + stage``."""
    return chunk * num_stages + stage


def chunk_of_part(num_stages: int, part: int) -> tuple[int, int]:
    """The ``(rank, chunk)`` holding part ``part`` of the model."""
    return part % num_stages, part // num_stages


def interleaved_1f1b(num_stages: int, num_microbatches: int, stage: int, chunks: int = 2) -> list[Action]:
    """Interleaved 1F1B on ``stage`` with ``chunks`` model chunks per rank; ends with one step."""
    check_args(num_stages, num_microbatches, stage)
    if chunks < 1:
        raise ScheduleError(f"chunks must be >= 1, got {chunks}")
    if chunks > 1 and num_microbatches % num_stages:
        raise ScheduleError(
            f"interleaved 1F1B needs microbatches ({num_microbatches}) to be a multiple of stages "
            f"({num_stages}): micro-batches go through each chunk in groups of {num_stages}; "
            f"use {num_microbatches + num_stages - num_microbatches % num_stages} micro-batches, for example"
        )
    group = num_stages * chunks
    total = num_microbatches * chunks

    def mb(k: int) -> int:
        return (k // group) * num_stages + k % num_stages

    def fwd(k: int) -> Action:
        return Action("F", mb(k), (k // num_stages) % chunks)

    def bwd(k: int) -> Action:
        return Action("B", mb(k), chunks - 1 - (k // num_stages) % chunks)

    if chunks == 1:
        warmup = min(num_stages - stage - 1, total)
    else:
        warmup = min(2 * (num_stages - stage - 1) + (chunks - 1) * num_stages, total)
    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [fwd(warmup + k), bwd(k)]
    out += [bwd(k) for k in range(total - warmup, total)]
    return out + [Action("S")]
