"""The end of a data-parallel step, A/B in one run: stepping by bucket and the tail bucket, each on and off.

    nice -n -20 python benchmarks/dp_step_tail.py --models mlp,resnet --runs 5

Two gloo ranks (local launcher, one thread each) train the models of ``benchmarks/dp_vs_ddp.py``
(SGD with momentum) as:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``;
- ``before``: ``DistributedOptimizer`` as it was before the two changes timed here: the last
  bucket not split and one update after the last reduction;
- ``bucket-step``: only stepping by bucket (:mod:`ringpipe.dp.bucket_step`: each bucket's
  parameters are updated as soon as it is reduced, while later buckets still travel);
- ``tail``: only the tail bucket (the first registered modules' parameters, up to
  ``first_bucket_bytes``, split off the last bucket: ``make_buckets(tail_cap=...)``);
- ``default``: both, as ``DistributedOptimizer`` does by default.

The update after the last reduction is forced by a no-op step hook on the wrapped optimizer (a
hook turns stepping by bucket off), the last bucket unsplit by building the buckets with
``tail_cap=0``. The variants take turns step by step (the order rotates every round), so load
from other jobs falls on all of them alike. Printed: per run the median step time of the slowest
rank per variant, and over runs the median and spread of each variant's ratio to ``before`` and
to ``ddp``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dp_vs_ddp import _loss, make_model  # noqa: E402

VARIANTS = ("ddp", "before", "bucket-step", "tail", "default")


def _build(comm: Any, kind: str, name: str) -> tuple[nn.Module, Any, torch.Tensor, torch.Tensor]:
    import ringpipe.dp.buckets as buckets
    import ringpipe.dp.gradient_reducer as gradient_reducer
    from ringpipe.dp import DistributedOptimizer

    model, x, y = make_model(kind)
    if name == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), x, y
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if name in ("before", "tail"):
        inner.register_step_post_hook(lambda *args: None)
    original = buckets.make_buckets
    if name in ("before", "bucket-step"):
        gradient_reducer.make_buckets = lambda *a, **k: original(*a, **{**k, "tail_cap": 0})
    try:
        opt = DistributedOptimizer(inner, model.named_parameters(), comm=comm)
    finally:
        gradient_reducer.make_buckets = original
    return model, opt, x, y


def _step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    opt.zero_grad()
    _loss(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def run_ranks(comm: Any, kind: str, rounds: int, names: list[str]) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    built = {n: _build(comm, kind, n) for n in names}
    for b in built.values():
        for _ in range(3):
            _step(*b)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        for n in order if (r // len(names)) % 2 == 0 else order[::-1]:
            comm.barrier()
            times[n].append(_step(*built[n]))
    mine = {n: statistics.median(t) for n, t in times.items()}
    return comm.allgather_object(mine)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,resnet")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=0, help="steps per variant and run (default: by model)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    from ringpipe.launch import spawn

    names = args.variants.split(",")
    default_rounds = {"small": 300, "transformer": 100, "mlp": 40, "resnet": 30}
    for kind in args.models.split(","):
        rounds = args.rounds or default_rounds.get(kind, 40)
        runs = []
        print(f"== {kind}: {rounds} steps per variant and run; load {os.getloadavg()[0]:.1f}", flush=True)
        for r in range(args.runs):
            every = spawn(run_ranks, 2, args=(kind, rounds, names))[0]
            slowest = {n: max(rank[n] for rank in every) for n in names}
            runs.append(slowest)
            print(f"run {r}: " + "  ".join(f"{n} {slowest[n] * 1e3:.1f} ms" for n in names)
                  + f"  (load {os.getloadavg()[0]:.1f})", flush=True)
        for den in ("before", "ddp"):
            if den not in names:
                continue
            for n in names:
                if n == den:
                    continue
                ratios = [run[n] / run[den] for run in runs]
                print(f"{kind} {n} / {den}: {statistics.median(ratios):.3f} "
                      f"({min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
