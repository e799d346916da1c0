"""``ringpipe plan``: every pipeline mode's predicted peak memory per stage, before a run.

Reads the same config as ``ringpipe train`` (``--config``, ``--set``, ``--mode``), builds the
model and one micro-batch of the data in this process, and prints, for seq, gpipe, 1f1b,
interleaved, zb_h1, zb_h2 and async side by side, each stage's predicted peak and its parts
(:mod:`ringpipe.pipeline.memory_plan`). With ``--memory-budget`` (or
``pipeline.memory_budget``) the modes that do not fit are marked, and the command exits 2 when
the config's own mode does not fit, with the figures. A config in a non-pipeline mode is
planned as mode 1f1b with the config's ``pipeline`` section (or its defaults).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ringpipe.train.config import ConfigError, resolve_raw, validate
from ringpipe.train.config_sections import MODE_NAMES, PIPELINE_MODES

__all__ = ["add_parser", "run_plan"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="predict each pipeline mode's peak memory per stage for a training config, before running it",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", "-c", metavar="FILE", default=None, help="the YAML or JSON config of `ringpipe train`")
    p.add_argument("--set", "-s", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one key, as for `ringpipe train` (repeatable)")
    p.add_argument("--mode", "-m", choices=MODE_NAMES, default=None, help="shortcut for --set mode=MODE")
    p.add_argument("--memory-budget", metavar="BYTES", default=None,
                   help="bytes a stage may hold, e.g. 2G or 512M (default: pipeline.memory_budget)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)
    return p


def _config(args: argparse.Namespace) -> Any:
    overrides = list(args.overrides)
    if args.mode is not None:
        overrides.insert(0, f"mode={args.mode}")
    raw = resolve_raw(args.config, overrides)
    if raw.get("mode") not in PIPELINE_MODES:
        raw = {**raw, "mode": "1f1b"}
    return validate(raw)


def run_plan(args: argparse.Namespace) -> int:
    import torch

    from ringpipe.pipeline.memory import MemoryBudgetError, parse_bytes
    from ringpipe.pipeline.memory_plan import MODES, check_budget, format_plan
    from ringpipe.train.datasets import load_dataset
    from ringpipe.train.models import build_model
    from ringpipe.train.modes import loss_fn
    from ringpipe.train.optimizers import build_optimizer, scaled_lr
    from ringpipe.train.pipeline_memory import plan_for

    try:
        cfg = _config(args)
        pc = cfg.pipeline
        assert pc is not None
        budget_text = args.memory_budget if args.memory_budget is not None else pc.memory_budget
        budget = parse_bytes(budget_text) if budget_text is not None else None
        data = load_dataset(cfg.data)
    except (ConfigError, MemoryBudgetError, ValueError, FileNotFoundError) as exc:
        print(f"ringpipe plan: {exc}", file=sys.stderr)
        return 2

    def model() -> torch.nn.Module:
        torch.manual_seed(cfg.seed)
        return build_model(cfg.model, data)

    lr, _ = scaled_lr(cfg.optimizer, 1)
    chunks = pc.chunks or 2

    def balance(parts: int) -> Any:
        if pc.balance is not None and len(pc.balance) == parts:
            return list(pc.balance)
        if pc.partition == "uniform":
            n = len(list(model().children())) if isinstance(model(), torch.nn.Sequential) else parts
            return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
        return "params" if pc.partition == "parameters" else "time"

    plans = plan_for(model, data.train, cfg.batch_size, pc.microbatches, pc.stages, balance, loss_fn(data.kind),
                     lambda ps: build_optimizer(ps, cfg.optimizer, lr), MODES, chunks=chunks,
                     recompute=pc.recompute, step_every=pc.step_every or 1, mitigations=pc.mitigations,
                     split_points=pc.split_points)
    if args.json:
        print(json.dumps({"mode": cfg.mode, "stages": pc.stages, "microbatches": pc.microbatches, "budget": budget,
                          "plans": [{"mode": p.mode, "error": p.error, "peak": p.peak,
                                     "stages": [s.as_dict() for s in p.stages]} for p in plans]}, indent=1))
    else:
        mb = cfg.batch_size // pc.microbatches
        print(f"ringpipe plan: model {cfg.model.name}, {pc.stages} stages, {pc.microbatches} micro-batches of {mb} "
              f"samples, optimizer {cfg.optimizer.name}, recompute {'on' if pc.recompute else 'off'}"
              + f"; interleaved: {chunks} chunks per rank")
        print("predicted peak bytes a stage holds (parameters, gradients, optimizer state, activations of the "
              "micro-batches in flight, weight stashes; not the working memory inside a pass)")
        print(format_plan(plans, budget))
    own = next(p for p in plans if p.mode == cfg.mode)
    if budget is not None and not own.error:
        try:
            check_budget(own, budget)
        except MemoryBudgetError as exc:
            print(f"ringpipe plan: {exc}", file=sys.stderr)
            return 2
    return 0
