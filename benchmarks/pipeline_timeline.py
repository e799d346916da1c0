"""Where a pipeline step's time goes, per rank: compute, waiting for the neighbour, and overhead between actions.

Runs ringpipe's schedules on the model and split of ``pipeline_vs_torch.py`` (2 ranks) and
stamps every forward, backward and optimizer step with the monotonic clock, which the
processes of one machine share. For each action, the gap since the rank's previous action is
split in two: *waiting* until the neighbour finished the action this one depends on (its
forward of the micro-batch for a forward, its backward for a backward), and *overhead*, the
rest of the gap: the transfer after the neighbour finished, receives, sends and the executor's
bookkeeping. An ideal pipeline has no overhead and waits only in its bubble.

The variants run in blocks (every variant once per block, alternating order) and the table
gives medians over blocks, in milliseconds per optimizer step. ``--check-bookkeeping`` also
times the stage's forward + backward with and without the asynchronous schedule's live-weight
hooks in one process (the pure bookkeeping cost per micro-batch, apart from compute).

    python benchmarks/pipeline_timeline.py --steps 20 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ringpipe.launch import spawn
from ringpipe.pipeline import PipelineTrainer
from ringpipe.pipeline.executor import PipelineExecutor
from ringpipe.pipeline.stage import StageRuntime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_vs_torch import Split, data, make_layers  # noqa: E402

__all__ = ["main", "breakdown"]

Event = tuple[str, int, float, float]  # kind, micro-batch, start, end


def stamped(log: list[Event], kind: str, fn: Callable[..., Any], mb: bool = True) -> Callable[..., Any]:
    def call(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            log.append((kind, a[0] if mb and a else -1, t0, time.perf_counter()))
    return call


def run(comm: Any, args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    layers = make_layers(args.width, args.blocks)
    is_async = schedule == "async"
    t = PipelineTrainer(
        comm, layers, balance=Split.make(len(layers), args.blocks, "flat").balance(), schedule=schedule,
        microbatches=args.microbatches, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01),
        loss_fn=nn.functional.cross_entropy, step_every=args.microbatches if is_async else 1,
    )
    x, y = data(args)
    feed = (x if t.is_first else None, y if t.is_last else None)

    def steps(n: int) -> None:
        if is_async:
            t.train_stream((feed for _ in range(n)), n)
        else:
            for _ in range(n):
                t.train_step(*feed)

    steps(args.warmup)
    log: list[Event] = []
    rt: StageRuntime = t.runtime
    ex: PipelineExecutor = t.executor
    rt.forward = stamped(log, "F", rt.forward)  # type: ignore[method-assign]
    rt.backward = stamped(log, "B", rt.backward)  # type: ignore[method-assign]
    ex.step = stamped(log, "S", ex.step)  # type: ignore[method-assign]
    for ch, kind in ((ex.act_in, "R"), (ex.grad_in, "R"), (ex.act_out, "X"), (ex.grad_out, "X")):
        if ch is not None:
            name = "get" if kind == "R" else "send"
            setattr(ch, name, stamped(log, kind, getattr(ch, name), mb=False))
    comm.barrier()
    t0 = time.perf_counter()
    steps(args.steps)
    t1 = time.perf_counter()
    comm.barrier()
    return {"events": log, "start": t0, "end": t1}


def worker(comm: Any, args: argparse.Namespace, names: list[str]) -> dict[str, list[dict]]:
    torch.set_num_threads(1)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for block in range(args.repeats):
        for n in names if block % 2 == 0 else names[::-1]:
            out[n].append(run(comm, args, n))
    return out


def breakdown(ranks: list[dict[str, Any]], steps: int) -> list[dict[str, float]]:
    """Per rank, ms per step: F, B, S compute; waiting; recv, send and other overhead; wall.

    A receive call before an action counts as *waiting* up to the moment the neighbour
    finished the action it depends on, and as *recv* overhead after that (the transfer and
    the call's own cost). Gaps between actions outside receive and send calls are *other*.
    """
    end_of = [{(k, m): e for k, m, _, e in r["events"] if k in ("F", "B")} for r in ranks]
    n = len(ranks)
    out = []
    for r, res in enumerate(ranks):
        acc = dict.fromkeys(("F", "B", "S", "wait", "recv", "send", "other", "tail"), 0.0)
        prev, in_calls = res["start"], 0.0
        recvs: list[tuple[float, float]] = []
        for kind, mb, s, e in res["events"]:
            if kind == "R":
                recvs.append((s, e))
                in_calls += e - s
                continue
            if kind == "X":
                acc["send"] += e - s
                in_calls += e - s
                continue
            acc[kind] += e - s
            dep = None
            if kind == "F" and r > 0:
                dep = end_of[r - 1].get(("F", mb))
            elif kind == "B" and r < n - 1:
                dep = end_of[r + 1].get(("B", mb))
            for rs, re_ in recvs:
                w = min(re_ - rs, max(0.0, dep - rs)) if dep is not None else 0.0
                acc["wait"] += w
                acc["recv"] += re_ - rs - w
            acc["other"] += max(0.0, s - prev) - in_calls
            prev, in_calls, recvs = e, 0.0, []
        acc["tail"] = res["end"] - prev  # after the last action: final sends, the end of a drain
        acc["wall"] = res["end"] - res["start"]
        out.append({k: 1e3 * v / steps for k, v in acc.items()})
    return out


def bookkeeping(width: int, rows: int, reps: int = 200) -> dict[str, float]:
    """Microseconds per forward + backward of a 2-block stage, plain and with live weights (tiny compute)."""
    torch.set_num_threads(1)
    mods = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
    rts = {"plain": StageRuntime(mods, 1, 3), "live_weights": StageRuntime(mods, 1, 3, live_weights=True)}
    x, g = torch.randn(rows, width), torch.randn(rows, width)
    times: dict[str, list[float]] = {k: [] for k in rts}
    for i in range(reps):
        for k, rt in rts.items() if i % 2 else list(rts.items())[::-1]:
            t0 = time.thread_time()
            rt.forward(i, (x,))
            rt.backward(i, (g,))
            times[k].append(time.thread_time() - t0)
    return {k: 1e6 * statistics.median(v[reps // 10:]) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="1f1b,async", help="comma-separated ringpipe schedules")
    ap.add_argument("--check-bookkeeping", action="store_true")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",")]
    load = os.getloadavg()[0]
    res = spawn(worker, 2, args=(args, names), env={"OMP_NUM_THREADS": "1"})
    print(f"# {os.cpu_count()} cores, load average {load:.2f} -> {os.getloadavg()[0]:.2f}; width {args.width}, "
          f"{args.blocks} blocks + head, batch {args.batch}, {args.microbatches} micro-batches, {args.steps} steps, "
          f"medians of {args.repeats} blocks, ms per step")
    print("| schedule | rank | wall | F | B | S | waiting | recv | send | other | after last action |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in names:
        per_block = [breakdown([res[r][n][b] for r in range(2)], args.steps) for b in range(args.repeats)]
        for r in range(2):
            med = {k: statistics.median(pb[r][k] for pb in per_block) for k in per_block[0][r]}
            print(f"| {n} | {r} | {med['wall']:.1f} | {med['F']:.1f} | {med['B']:.1f} | {med['S']:.1f} | "
                  f"{med['wait']:.1f} | {med['recv']:.1f} | {med['send']:.1f} | "
                  f"{med['other']:.1f} | {med['tail']:.1f} |")
    if args.check_bookkeeping:
        for width, rows in ((8, 4), (args.width, args.batch // args.microbatches)):
            bk = bookkeeping(width, rows)
            print(f"# forward+backward of one micro-batch ({rows}x{width}), thread CPU us: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in bk.items()))


if __name__ == "__main__":
    main()
