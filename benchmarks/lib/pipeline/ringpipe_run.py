"""One timed run of a ringpipe schedule on the benchmark's model and split (one rank's side).

Builds a :class:`PipelineTrainer` on the shared layers and :class:`Split`, times ``--steps``
steps after ``--warmup`` (the asynchronous schedule as one stream of steps), and records each
compute call's thread CPU, peak activation memory and what the rank holds, the same way as
``lib/pipeline/torch_run.py`` does for torch.distributed.pipelining.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

import ringpipe.pipeline.stage as stage_mod
from lib.pipeline.meters import ActivationMeter, cpu_timed, describe, medians, timed
from lib.pipeline.model import Split, data, make_layers
from ringpipe.pipeline import PipelineTrainer

__all__ = ["RINGPIPE_NEW", "RINGPIPE_SYNC", "ringpipe_run"]

RINGPIPE_SYNC = ["seq", "gpipe", "1f1b"]
RINGPIPE_NEW = {"interleaved_1f1b": "loop", "zb_h1": "flat", "zb_h2": "flat"}  # run when the installed ringpipe registers them


def ringpipe_run(comm: Any, args: argparse.Namespace, schedule: str, recompute: bool = False) -> dict[str, Any]:
    layers = make_layers(args.width, args.blocks)
    layout = RINGPIPE_NEW.get(schedule, "flat")
    split = Split.make(len(layers), args.blocks, layout, args.first_blocks)
    is_async = schedule == "async"
    extra: dict[str, Any] = {"chunks": 2} if layout == "loop" else {}
    t = PipelineTrainer(
        comm, layers, balance=split.balance(), schedule=schedule, microbatches=args.microbatches,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01),
        loss_fn=nn.functional.cross_entropy, recompute=recompute,
        step_every=args.microbatches if is_async else 1, **extra,
    )
    rt = t.runtime
    mods = [r.module for r in getattr(t, "runtimes", [rt])]
    cpu_log: dict[str, list[float]] = {}
    for r in getattr(t, "runtimes", [rt]):
        for method, kind in (("forward", "F"), ("backward", "B"), ("backward_input", "I"), ("backward_weight", "W")):
            if hasattr(r, method):
                setattr(r, method, cpu_timed(getattr(r, method), cpu_log, f"{r.stage}:{kind}"))
    x, y = data(args)
    feed = (x if t.is_first else None, y if t.is_last else None)
    meter = ActivationMeter([p for m in mods for p in m.parameters()])
    if recompute:
        orig_fwd = rt.forward

        def fwd(*a: Any, **k: Any) -> Any:
            out = orig_fwd(*a, **k)
            meter.kept = sum(v.numel() * v.element_size() for r in rt._records.values() for v in r.inputs)
            meter.peak = max(meter.peak, meter.live + meter.kept)
            return out
        rt.forward = fwd  # type: ignore[method-assign]
    orig_live = stage_mod.live_weights
    stage_mod.live_weights = meter.nested(orig_live)  # type: ignore[assignment]
    try:
        with meter.hooks():
            if is_async:
                dt, cpu = timed(comm, lambda: t.train_stream((feed for _ in range(args.warmup)), args.warmup),
                           lambda: t.train_stream((feed for _ in range(args.steps)), args.steps))
            else:
                dt, cpu = timed(comm, lambda: [t.train_step(*feed) for _ in range(args.warmup)],  # type: ignore[func-returns-value]
                           lambda: [t.train_step(*feed) for _ in range(args.steps)])  # type: ignore[func-returns-value]
    finally:
        stage_mod.live_weights = orig_live  # type: ignore[assignment]
    return {"samples_per_s": args.steps * args.batch / dt, "cpu_ms_per_step": 1e3 * cpu / args.steps,
            "peak_act_mib": meter.peak / 2**20, "costs": medians(cpu_log), **describe(mods, layers)}

