"""Pipeline throughput and activation memory: ringpipe's schedules against torch.distributed.pipelining, 2 ranks.

Both systems get their stages from ONE :class:`Split` of one list of layers (an MLP of
``--blocks`` Linear+ReLU blocks and a Linear head, built with the same seed): the split says
which layers form each model chunk and which rank holds each chunk. Two-stage schedules use
one chunk per rank; interleaved and V-shaped ones cut the same per-rank layers into two chunks
per rank, so they need two blocks a rank: when the split leaves a rank fewer, those variants are
skipped before anything runs, with one line saying which, why and which option fixes it (they
never appear in a ratio). Where the cut between the ranks falls is chosen from measurement
(``--balance measured``, the default): each block's forward + backward of one micro-batch is timed before the
run (one thread, as in the run; the first block without the input gradient that the first stage
never computes, the head and the loss with the last block) and ringpipe's exact splitter picks
the cut that makes the slower stage cheapest; the two stages' timed costs are printed, and each
variant's own per-rank compute per micro-batch in the run is printed next to its throughput.
Blocks are the unit of the cut, so the default model has many small ones (32 blocks of width
362, the multiply-adds of 4 blocks of 1024), which balances within a few per cent; ``--balance
4,5 --blocks 4 --width 1024`` gives the earlier split (2 blocks | 2 blocks + head, the last stage
1.2-1.37x the first). Before any ratio is printed, every variant reports, per rank, the parameter count and
the list of layers its stages actually hold (found by identity in the shared list); a ratio
between two variants whose ranks hold different work is refused.

Same data, batch, micro-batches, SGD optimizer, one thread per process, warm-up. The variants
run in blocks (every variant once per block, the order rotated from block to block) so that
drift of a shared machine falls on all of them; the median and the spread over blocks are
reported, and the ratios are medians of the per-block ratios. Peak activation memory is
measured the same way on both sides: live bytes of the storages autograd saves for backward
(a saved-tensors hook; each storage counted once, a parameter's storage not at all) plus the
stage inputs ringpipe keeps for recomputation, peak over the run, per rank. Next to the
measured figures: what the schedules imply, computed from their action lists
(``lib/pipeline/schedule_sim.py``: F = 1, B = 2, I = W = 1 per stage), and the time per step they imply
with each variant's own measured thread CPU per action. Times per step are those of the steady
state of consecutive steps: a rank starts the next step when it is done with this one (neither
system has a barrier between steps), which shortens a step of the schedules whose first rank
finishes first (ZB-H2, V shapes); for the asynchronous schedule, which has no steps to separate,
it is the mean over the timed stream of ``--steps`` steps (one fill and one drain). Two bubble
columns, both fractions of the ranks' time that no rank computes:

- ``bubble, one step``: of one step run alone, from its first action to its last (for async,
  of the whole stream of ``--steps`` steps);
- ``bubble, steady state``: ``1 - ideal / time per step``, where time per step is the column
  beside it (units per micro-batch) and ideal is a rank's compute per micro-batch (F + B = 3
  units); it is what consecutive steps idle and the figure the throughput ratios follow (ZB-H2
  and torch's ZBV: 0.077 and 0.040 for one step, 0 in the steady state; async: its stream's).

    python benchmarks/pipeline_vs_torch.py --batch 256 --microbatches 4 --steps 20 --repeats 5

``--backend mpi`` runs ringpipe's variants over its MPI backend instead of gloo (``mpirun -n 2``,
``lib/pipeline/ranks.py``; ``--mca KEY=VALUE`` passes Open MPI parameters). torch's schedules need
c10d's process groups and cannot run there, so ``--backend mpi`` runs ringpipe's variants only
and refuses a torch variant named in ``--only`` rather than mix two transports in one table:

    python benchmarks/pipeline_vs_torch.py --backend mpi --steps 20 --repeats 9 \\
        --only "ringpipe async_1f1b,ringpipe 1f1b,ringpipe zb_h2"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import report, stats  # noqa: E402
from lib.pipeline.meters import describe  # noqa: E402
from lib.pipeline.model import (  # noqa: E402
    Split,
    add_model_args,
    add_run_args,
    choose_split,
    make_layers,
    quick,
    split_line,
)
from lib.pipeline.ranks import add_backend_args, backend_line, check_backend_args, run_two_ranks  # noqa: E402
from lib.pipeline.theory import theory  # noqa: E402
from lib.pipeline.torch_run import TORCH_SCHEDULES  # noqa: E402
from lib.pipeline.variants import misfits, probe_torch, variant_names, worker  # noqa: E402

__all__ = ["main"]


def stage_cost(reps: list[dict]) -> float:
    """A rank's compute per micro-batch in the run: the sum over its chunks and kinds of the median call
    (median over blocks), the same figure for ringpipe and torch."""
    return 1e3 * statistics.median(sum(r.get("costs", {}).values()) for r in reps)


def skip_lines(skipped: dict[str, str]) -> list[str]:
    """One line per reason: the variants skipped for it (never run, never in a ratio), why, and the fix."""
    by_why: dict[str, list[str]] = {}
    for name, why in skipped.items():
        by_why.setdefault(why, []).append(name)
    return [f"# skipped {', '.join(names)}: {why}" for why, names in by_why.items()]


def tables(args: argparse.Namespace, r0: dict[str, list[dict]], r1: dict[str, list[dict]],
           failed: dict[str, str], skipped: dict[str, str] | None = None) -> None:
    load = os.getloadavg()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{backend_line(args)}, 2 processes x 1 thread; load average before/after {args.load_before} / {load[0]:.2f}")
    print(f"# MLP width {args.width}, {args.blocks} blocks + head, batch {args.batch}, {args.microbatches} "
          f"micro-batches, SGD, {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} blocks")
    print(split_line(args))
    for line in skip_lines(skipped or {}):
        print(line)
    ref = (Split.make(len(make_layers(1, args.blocks)), args.blocks, "flat", args.first_blocks),
           make_layers(args.width, args.blocks))
    ref = tuple(describe([nn.Sequential(*(ref[1][i] for i in c))], ref[1]) for c in ref[0].chunks)
    layouts: dict[str, list[str]] = {}
    equal: dict[str, bool] = {}
    for name in r0:
        a, b = r0[name][0], r1[name][0]
        # ranks are interchangeable (one process each): compare the multiset of per-rank work
        work = sorted((x["params"], x["kinds"]) for x in (a, b))
        same = work == sorted((x["params"], x["kinds"]) for x in ref)
        equal[name] = same
        key = f"rank 0: {a['params']} params, layers {a['layers']} | rank 1: {b['params']} params, layers {b['layers']}"
        layouts.setdefault(key, []).append(name + ("" if same else " (DIFFERENT WORK)"))
    print("\n## What each rank holds (parameter count, indices into the shared layer list)")
    for key, names in layouts.items():
        print(f"- {', '.join(names)}: {key}")
    th = theory(args, r0, r1)
    med = {n: statistics.median(r["samples_per_s"] for r in v) for n, v in r0.items()}
    print("\n| variant | samples/s median | spread (min-max) | CPU ms/step rank 0 / 1 | bubble, one step (schedule) "
          "| bubble, steady state (1 - 3 / time per step) | time/step (schedule, units per micro-batch) "
          "| ms/step (schedule x measured costs) | F+B(+I+W) ms/micro-batch rank 0 / 1 | peak act. MiB rank 0 / 1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, v in r0.items():
        xs = [r["samples_per_s"] for r in v]
        b, per_step, per_step_ms, b_steady = th.get(n, (float("nan"),) * 4)
        cpu = [statistics.median(r["cpu_ms_per_step"] for r in res[n]) for res in (r0, r1)]
        print(f"| {n} | {med[n]:.0f} | {min(xs):.0f}-{max(xs):.0f} ({(max(xs) - min(xs)) / med[n]:.0%}) | "
              f"{cpu[0]:.0f} / {cpu[1]:.0f} | "
              f"{b:.3f} | {b_steady:.3f} | {per_step:.3f} | {per_step_ms:.1f} | {stage_cost(r0[n]):.2f} / {stage_cost(r1[n]):.2f} | "
              f"{v[0]['peak_act_mib']:.2f} / {r1[n][0]['peak_act_mib']:.2f} |")
    for name, why in failed.items():
        print(f"| torch {name} | failed: {why} |" + " |" * 8)
    print("\nbubble, one step: idle share of one step run alone (async: of the whole stream); bubble, steady "
          "state: 1 - ideal / time per step, ideal = a rank's compute per micro-batch (F + B = 3 units), time "
          "per step = the steady state of consecutive steps (async: the stream's mean, one fill and drain)")

    headline: list[tuple[str, str, stats.Spread]] = []

    def ratio(a: str, b: str) -> str:
        if not (equal[a] and equal[b]):
            return f"{a} / {b}: REFUSED, the ranks do not hold the same layers and parameters"
        per_block = [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(r0[a], r0[b], strict=True)]
        if b.startswith("torch ") and not any(h[0].startswith(f"pipeline step time, {a} ") for h in headline):
            # the headline's ratio is a time: ringpipe's step over torch's
            headline.append((f"pipeline step time, {a} (2 ranks, MLP width {args.width}, {args.blocks} blocks)",
                             f"torch.distributed.pipelining, {b[6:]}",
                             stats.ratios([y["samples_per_s"] for y in r0[b]], [x["samples_per_s"] for x in r0[a]])))
        pred = th[b][1] / th[a][1] if a in th and b in th else float("nan")
        pred_ms = th[b][2] / th[a][2] if a in th and b in th else float("nan")
        bubbles = f"{th[a][3]:.3f} / {th[b][3]:.3f}" if a in th and b in th else "n/a"
        return (f"{a} / {b}: {statistics.median(per_block):.3f}x median of per-block ratios "
                f"(range {min(per_block):.3f}-{max(per_block):.3f}); schedules alone predict {pred:.3f}x "
                f"(steady-state bubble {bubbles}), with each side's measured CPU per action {pred_ms:.3f}x")

    sync_r = [n for n in r0 if n.startswith("ringpipe") and "async" not in n and "+" not in n]
    sync_t = [n for n in r0 if n.startswith("torch")]
    print()
    if sync_t and sync_r:
        best_r, best_t = max(sync_r, key=med.__getitem__), max(sync_t, key=med.__getitem__)
        print("- best synchronous: " + ratio(best_r, best_t))
        for s in ("gpipe", "1f1b"):
            if f"torch {s}" in r0 and f"ringpipe {s}" in r0:
                print("- same schedule: " + ratio(f"ringpipe {s}", f"torch {s}"))
    if "ringpipe async_1f1b" in r0 and "ringpipe 1f1b" in r0:
        print("- " + ratio("ringpipe async_1f1b", "ringpipe 1f1b"))
    if "ringpipe zb_h2" in r0 and "ringpipe 1f1b" in r0:
        print("- " + ratio("ringpipe zb_h2", "ringpipe 1f1b"))
    if headline:
        report.headline(headline)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Columns 'bubble, one step': idle share of one step run alone (async: of the whole stream of\n"
               "--steps steps). 'bubble, steady state': 1 - ideal / time per step, with time per step the\n"
               "steady state of consecutive steps in units per micro-batch (async: the stream's mean) and\n"
               "ideal a rank's compute per micro-batch (F + B = 3 units). Both from the schedules' action lists.")
    add_model_args(ap)
    add_run_args(ap)
    ap.add_argument("--only", help="comma-separated variants to run (e.g. 'ringpipe async_1f1b,ringpipe 1f1b')")
    ap.add_argument("--profile", metavar="DIR", help="write each rank's cProfile statistics of each run to DIR")
    ap.add_argument("--json", action="store_true")
    add_backend_args(ap)
    ap.add_argument("--quick", action="store_true",
                    help="seconds: a tiny model, 2 steps, one block, ringpipe's and torch's 1f1b and gpipe")
    args = ap.parse_args(argv)
    if args.quick:
        quick(args)
        args.only = args.only or "ringpipe 1f1b,torch 1f1b,ringpipe gpipe,torch gpipe,ringpipe async_1f1b"
    check_backend_args(args)
    report.header("pipeline_vs_torch", argv)
    args.load_before = f"{os.getloadavg()[0]:.2f}"
    only = [v.strip() for v in args.only.split(",")] if args.only else None
    known = variant_names(TORCH_SCHEDULES)
    unknown = sorted(set(only or ()) - set(known))
    if unknown:
        raise SystemExit(f"--only: unknown variants {unknown}; valid: {known}")
    if args.backend == "mpi":
        torch_asked = [v for v in only or () if v.startswith("torch ")]
        if torch_asked:
            raise SystemExit(f"--backend mpi: {torch_asked} cannot run over MPI (torch.distributed.pipelining "
                             "needs c10d's process groups, here gloo); run torch's variants with --backend gloo, "
                             "and only ringpipe's with --backend mpi")
        only = only or [v for v in known if v.startswith("ringpipe ")]
        print("# --backend mpi: ringpipe's variants only (torch's need c10d, not MPI)", file=sys.stderr)
    args.first_blocks, args.stage_ms, args.balance_how = choose_split(args)
    print(split_line(args), file=sys.stderr, flush=True)  # early: the run takes minutes
    skipped = misfits(args, only or known)  # before anything runs: their layout does not fit the split
    for line in skip_lines(skipped):
        print(line, file=sys.stderr, flush=True)
    if only:
        only = [v for v in only if v not in skipped]
        if not only:
            raise SystemExit("--only: every variant asked for is skipped; " + "; ".join(x[2:] for x in skip_lines(skipped)))
        ok, failed = [v.split()[1] for v in only if v.startswith("torch ")], {}
    else:
        ok, failed = probe_torch(args, [s for s in TORCH_SCHEDULES if f"torch {s}" not in skipped])
    r0, r1 = run_two_ranks(args, worker, (args, ok, only, list(skipped)))
    if args.json:
        print(json.dumps({"rank0": r0, "rank1": r1, "failed": failed, "skipped": skipped}, default=str))
        return 0
    tables(args, r0, r1, failed, skipped)
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
