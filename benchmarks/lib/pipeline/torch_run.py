"""One timed run of a torch.distributed.pipelining schedule on the benchmark's model and split.

Builds torch's ``PipelineStage`` objects from the same layers and :class:`Split` as ringpipe's
side (``lib/pipeline/ringpipe_run.py``), times ``--steps`` steps after ``--warmup``, and records
what the rank really runs (torch's ``pipeline_order`` is for display only), each compute call's
thread CPU, peak activation memory and what the rank holds.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lib.pipeline.meters import ActivationMeter, cpu_timed, describe, medians, timed
from lib.pipeline.model import Split, data, make_layers

__all__ = ["TORCH_SCHEDULES", "record", "torch_run"]

TORCH_SCHEDULES = {  # name -> (class name, chunk layout)
    "gpipe": ("ScheduleGPipe", "flat"),
    "1f1b": ("Schedule1F1B", "flat"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
}


def torch_run(comm: Any, args: argparse.Namespace, name: str) -> dict[str, Any]:
    import torch.distributed.pipelining as pp

    cls_name, layout = TORCH_SCHEDULES[name]
    layers = make_layers(args.width, args.blocks)
    split = Split.make(len(layers), args.blocks, layout, args.first_blocks)
    mods = [nn.Sequential(*(layers[i] for i in split.chunks[c])) for c in split.chunks_of(comm.rank)]
    stages = [pp.PipelineStage(m, c, len(split.chunks), torch.device("cpu"), group=dist.group.WORLD)
              for m, c in zip(mods, split.chunks_of(comm.rank), strict=True)]
    log: list[tuple[int, str, int]] = []  # what this rank really runs (torch's pipeline_order is for display)
    cpu_log: dict[str, list[float]] = {}
    for st in stages:
        record(st, log, cpu_log)
    cls = getattr(pp, cls_name)
    sched = cls(stages[0] if layout == "flat" else stages, args.microbatches, loss_fn=nn.functional.cross_entropy)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    x, y = data(args)
    first, last = split.ranks[0] == comm.rank, split.ranks[-1] == comm.rank
    meter = ActivationMeter(params)

    def step() -> None:
        opt.zero_grad()
        kw: dict[str, Any] = {"target": y, "losses": []} if last else {}
        log.clear()
        sched.step(*((x,) if first else ()), **kw)
        opt.step()

    with meter.hooks():
        dt, cpu = timed(comm, lambda: [step() for _ in range(args.warmup)],  # type: ignore[func-returns-value]
                   lambda: [step() for _ in range(args.steps)])  # type: ignore[func-returns-value]
    return {"samples_per_s": args.steps * args.batch / dt, "cpu_ms_per_step": 1e3 * cpu / args.steps,
            "peak_act_mib": meter.peak / 2**20, "ops": list(log), "costs": medians(cpu_log),
            "chunks": len(split.chunks), **describe(mods, layers)}


def record(stage: Any, log: list[tuple[int, str, int]], cpu_log: dict[str, list[float]]) -> None:
    """Log ``(stage, F/B/I/W, micro-batch)`` for every compute call of a torch ``PipelineStage``,
    and each call's thread CPU seconds in ``cpu_log["stage:kind"]``."""
    fwd, bwd, wgt, s = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk, stage.stage_index

    def forward(mb: int, *a: Any, **k: Any) -> Any:
        log.append((s, "F", mb))
        return cpu_timed(fwd, cpu_log, f"{s}:F")(mb, *a, **k)

    def backward(mb: int, loss: Any = None, full_backward: bool = True, **k: Any) -> Any:
        kind = "B" if full_backward else "I"
        log.append((s, kind, mb))
        return cpu_timed(bwd, cpu_log, f"{s}:{kind}")(mb, loss, full_backward, **k)

    def weight(mb: int, *a: Any, **k: Any) -> Any:
        log.append((s, "W", mb))
        return cpu_timed(wgt, cpu_log, f"{s}:W")(mb, *a, **k)

    stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk = forward, backward, weight
