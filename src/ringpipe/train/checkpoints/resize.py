"""Resuming a data-parallel run on another number of ranks: what carries over, and what changes.

A data-parallel checkpoint (modes ``single``, ``ddp``, ``dp``) holds one model and one
optimizer state, the same on every replica, so it can continue on any number of ranks, and in
any of the three modes, as Horovod elastic and torch elastic jobs do. The rules:

* **Clocks.** The global step (optimizer steps taken) and the samples seen carry over. The
  epoch is ``samples seen / records`` from then on; the run still ends after ``epochs`` epochs
  (``max_steps`` still counts global steps).
* **Batch.** ``batch_size`` is per replica, as before: the global batch becomes
  ``batch_size x new replicas``.
* **Learning rate.** The rate is what the configured schedule gives at the current epoch for a
  run of the new size: ``optimizer.lr x scale x f(epoch)`` with ``scale`` the number of
  replicas when ``optimizer.scale_lr`` (Goyal et al.'s linear rule, Horovod's ``lr x
  hvd.size()``), else 1; the warmup's starting factor follows the new scale too. Optimizer
  state (momentum, Adam moments and step counts) carries over unchanged.
* **Data.** Within a pass the replicas read the shuffled permutation of the pass contiguously,
  ``global_batch`` samples a step, so the samples already seen in the interrupted pass are its
  first ``start + replicas x offset`` positions. The rest of that pass, every sample not yet
  seen in it exactly once, is dealt to the new replicas round-robin; when it does not divide
  evenly, up to ``new replicas - 1`` of its first samples are read twice (the padding rule of
  ``torch.utils.data.DistributedSampler``). The following passes are DistributedSampler's
  shards for the new size. No sample of the interrupted pass is skipped.
* **Per-rank state.** The partial metric sums of the open log window and epoch are summed
  onto rank 0 (the totals are kept). A rank that existed before gets its RNG state back; a new
  rank keeps its fresh per-rank seed (dropout masks cannot match another world size anyway).

Pipeline modes keep each rank's stage (and its optimizer state) in the checkpoint, so they
continue only on the number of ranks that wrote it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_PARALLEL_MODES",
    "replicas_of",
    "resume_refusal",
    "resharded_stream",
    "samples_seen",
    "summed_tally",
    "total_steps_from",
]

#: modes whose checkpoint is one model and optimizer state, equal on every replica
DATA_PARALLEL_MODES = ("single", "ddp", "dp")


def resume_refusal(path: str | Path, ckpt: dict[str, Any], mode: str, world_size: int) -> str:
    """Why a run of ``mode`` on ``world_size`` ranks cannot continue checkpoint ``ckpt`` ("" if it can)."""
    old_mode, old_world = ckpt["mode"], int(ckpt["world_size"])
    if old_mode == mode and old_world == world_size:
        return ""
    if old_mode in DATA_PARALLEL_MODES and mode in DATA_PARALLEL_MODES:
        return ""
    if old_mode in DATA_PARALLEL_MODES or mode in DATA_PARALLEL_MODES:
        family = "data-parallel" if old_mode in DATA_PARALLEL_MODES else "pipeline"
        return (
            f"--resume: {path} was written by mode {old_mode!r} on {old_world} ranks; this run is mode {mode!r} "
            f"on {world_size}: a {family} checkpoint continues only in a {family} mode "
            f"({', '.join(DATA_PARALLEL_MODES) if family == 'data-parallel' else 'the same mode'}); "
            f"resume with --mode {old_mode}, or start a new run in another --run-dir"
        )
    return (
        f"--resume: {path} was written by mode {old_mode!r} on {old_world} ranks; this run is mode {mode!r} "
        f"on {world_size}: a pipeline checkpoint holds each rank's own stage and optimizer state, so it "
        f"continues only in mode {old_mode!r} on {old_world} ranks: resume with --mode {old_mode} and "
        f"--nprocs {old_world} (or launch {old_world} ranks)"
    )


def replicas_of(ckpt: dict[str, Any], default: int) -> int:
    """The data-parallel replicas of the run of ``ckpt``; older checkpoints do not say: its world
    size for a data-parallel mode, else ``default`` (a pipeline continues only on its own world)."""
    if ckpt.get("replicas"):
        return int(ckpt["replicas"])
    return int(ckpt["world_size"]) if ckpt["mode"] in DATA_PARALLEL_MODES else default


def samples_seen(ckpt: dict[str, Any], replicas: int) -> int:
    """Samples the run of ``ckpt`` (on ``replicas``) had read; checkpoints without the count: ``step x global batch``."""
    if "samples" in ckpt:
        return int(ckpt["samples"])
    return int(ckpt["step"]) * int(ckpt["config"]["batch_size"]) * replicas


def total_steps_from(epochs: float, records: int, global_batch: int, step: int, samples: int) -> int:
    """The global step at which ``epochs`` epochs are done, going on from ``samples`` read at ``step``."""
    left = epochs * records - samples
    return step + max(0, math.ceil(left / global_batch - 1e-9))


def resharded_stream(states: list[dict[str, Any]], replicas: int, records: int) -> dict[str, Any]:
    """The batch-stream state of every new replica from the old replicas' states (see the module's description).

    ``states``: each old replica's ``ShardStream.state_dict()`` (they are at the same position).
    """
    positions = {(int(s["pass"]), int(s["offset"]), int(s.get("start", 0))) for s in states}
    if len(positions) != 1:
        raise ValueError(f"the replicas' batch streams are at different positions {sorted(positions)}: "
                         f"the checkpoint is not of a data-parallel run")
    pass_, offset, start = positions.pop()
    seen = start + replicas * offset
    if seen >= records:  # only the padding of the pass was left: it is not read again
        return {"pass": pass_ + 1, "offset": 0, "start": 0}
    return {"pass": pass_, "offset": 0, "start": seen}


def summed_tally(values: list[Any], rank: int) -> Any:
    """Rank ``rank``'s share of the old ranks' partial metric sums: all of them on rank 0, zeros elsewhere."""
    total = values[0].clone()
    for value in values[1:]:
        total += value
    return total if rank == 0 else total.zero_()
