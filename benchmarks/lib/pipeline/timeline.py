"""Where a pipeline step's time goes, per rank: compute, waiting for the neighbour, and overhead between actions.

Runs ringpipe's schedules on the model and split of ``pipeline_vs_torch.py`` (2 ranks; the same
options: by default a split chosen from each block's measured cost, printed with the two stages'
timed cost) and
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

A second table gives each rank's CPU per micro-batch by thread CPU time (forward, backward, its
share of the optimizer step, message calls, the executor's other work, gloo's threads), which
the load of a shared machine disturbs far less than wall time, and from those costs the time
per step that 1F1B and the asynchronous stream can at best reach on this split (each stage
busy with exactly what it was measured to do, messages free or 0.25 ms): the bound that
async / 1F1B is to be read against. It differs from the 1.25x of equal stages where the stages
are not equal (with ``--balance 4,5 --blocks 4 --width 1024`` the last stage also computes the
input gradient of its first layer and the head and loss, so it is 1.2-1.37x the first), and in
the asynchronous steady state the last stage's optimizer step lies on the critical path (in
1F1B it overlaps the first stage's last backward).

    python benchmarks/pipeline_breakdown.py --by timeline --steps 20 --repeats 5
    python benchmarks/pipeline_breakdown.py --by timeline --steps 20 --repeats 5 --balance 4,5 --blocks 4 --width 1024  # earlier split

``--backend mpi`` runs the ranks over ringpipe's MPI backend (``lib/pipeline/ranks.py``); there the
message calls' CPU includes Open MPI's busy-polling while a receive waits, so the bounds from
it are low; ``pipeline_breakdown.py --by profile --backend mpi`` leaves the receives' CPU out of its bounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lib.pipeline.model import (
    Split,
    add_model_args,
    add_run_args,
    choose_split,
    data,
    make_layers,
    split_line,
)
from lib.pipeline.ranks import add_backend_args, backend_line, check_backend_args, run_two_ranks
from ringpipe.pipeline import PipelineTrainer
from ringpipe.pipeline.executor import PipelineExecutor
from ringpipe.pipeline.stage import StageRuntime

__all__ = ["add_variant_args", "bookkeeping", "breakdown", "cpu_profile", "predict", "run_variants", "threads_cpu",
           "timeline_report", "worker"]

Event = tuple[str, int, float, float, float]  # kind, micro-batch, start, end, thread CPU seconds


def stamped(log: list[Event], kind: str, fn: Callable[..., Any], mb: bool = True) -> Callable[..., Any]:
    def call(*a: Any, **k: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            log.append((kind, a[0] if mb and a else -1, t0, time.perf_counter(), time.thread_time() - c0))
    return call


def threads_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads, by thread name and id (Linux ``/proc``).

    From ``schedstat`` (nanoseconds on CPU) where the kernel has it, else from ``stat`` (clock ticks,
    10 ms: too coarse for a thread that runs a millisecond per micro-batch over a short run).
    """
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
            name = raw[raw.index("(") + 1: raw.rindex(")")]
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    out[f"{name}:{tid}"] = int(f.read().split()[0]) / 1e9
                continue
            except (OSError, ValueError, IndexError):
                pass
            fields = raw[raw.rindex(")") + 2:].split()
            out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    except OSError:
        pass
    return out


def run(comm: Any, args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    layers = make_layers(args.width, args.blocks)
    is_async = schedule == "async"
    t = PipelineTrainer(
        comm, layers, balance=Split.make(len(layers), args.blocks, "flat", args.first_blocks).balance(), schedule=schedule,
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
    th0 = threads_cpu()
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    steps(args.steps)
    t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
    th1 = threads_cpu()
    comm.barrier()
    per_thread = {k: v - th0.get(k, 0.0) for k, v in th1.items() if v - th0.get(k, 0.0) > 0}
    return {"events": log, "start": t0, "end": t1, "thread_cpu": c1 - c0, "process_cpu": p1 - p0,
            "per_thread": per_thread}


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
    end_of = [{(k, m): e for k, m, _, e, _ in r["events"] if k in ("F", "B")} for r in ranks]
    n = len(ranks)
    out = []
    for r, res in enumerate(ranks):
        acc = dict.fromkeys(("F", "B", "S", "wait", "recv", "send", "other", "tail"), 0.0)
        prev, in_calls = res["start"], 0.0
        recvs: list[tuple[float, float]] = []
        for kind, mb, s, e, _ in res["events"]:
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


def cpu_profile(res: dict[str, Any], steps: int, m: int) -> dict[str, float]:
    """One rank's CPU per micro-batch (ms): F, B, S (a step's share), the message calls, the rest of the
    main thread (executor bookkeeping), other threads (gloo's I/O), and the main thread's idle time.

    Thread CPU time is what the load disturbs least: a preempted thread is not charged for it.
    """
    acc = dict.fromkeys(("F", "B", "S", "R", "X"), 0.0)
    for kind, _, _, _, cpu in res["events"]:
        acc[kind] += cpu
    n = steps * m
    out = {k: 1e3 * v / n for k, v in acc.items()}
    out["msg"] = out.pop("R") + out.pop("X")
    out["other"] = 1e3 * (res["thread_cpu"] - sum(acc.values())) / n
    out["threads"] = 1e3 * (res["process_cpu"] - res["thread_cpu"]) / n
    out["idle"] = 1e3 * (res["end"] - res["start"] - res["thread_cpu"]) / n
    return out


def predict(costs: list[dict[str, float]], m: int, steps: int, latency: float = 0.0) -> dict[str, float]:
    """ms per step of 1F1B and of the asynchronous stream, 2 stages, from measured per-stage costs.

    Each stage's forward costs its F plus its bookkeeping (``other``), a backward its B plus its
    message calls, a step its S (per step); a message takes ``latency`` ms. The stages run their
    action lists (ringpipe's own) as soon as the neighbour's message is there: the bound that
    the measured compute alone allows, against which the measured wall time can be read.
    """
    from ringpipe.pipeline.schedules import async_1f1b, one_f_one_b

    def run(lists: list[list[Any]]) -> float:
        cost = [{"F": c["F"] + c["other"], "B": c["B"] + c["msg"], "S": c["S"] * m} for c in costs]
        free, pos, act, grad = [0.0, 0.0], [0, 0], {}, {}
        seen = [{"F": 0, "B": 0}, {"F": 0, "B": 0}]
        while pos[0] < len(lists[0]) or pos[1] < len(lists[1]):
            moved = False
            for s in (0, 1):
                while pos[s] < len(lists[s]):
                    kind = lists[s][pos[s]].kind
                    k = seen[s].get(kind, 0)
                    start = free[s]
                    if kind == "F" and s == 1:
                        if k not in act:
                            break
                        start = max(start, act[k] + latency)
                    if kind == "B" and s == 0:
                        if k not in grad:
                            break
                        start = max(start, grad[k] + latency)
                    free[s] = start + cost[s][kind]
                    if kind in ("F", "B"):
                        seen[s][kind] = k + 1
                        if kind == "F" and s == 0:
                            act[k] = free[s]
                        if kind == "B" and s == 1:
                            grad[k] = free[s]
                    pos[s] += 1
                    moved = True
            if not moved:
                raise RuntimeError("the schedules deadlock")
        return max(free)

    sync = run([one_f_one_b(2, m, s) * steps for s in (0, 1)])
    stream = run([async_1f1b(2, m * steps, s, m) for s in (0, 1)])
    return {"1f1b": sync / steps, "async": stream / steps}


def bookkeeping(width: int, rows: int, reps: int = 200, blocks: int = 2) -> dict[str, float]:
    """Microseconds per forward + backward of a stage of ``blocks`` Linear+ReLU blocks, plain and with
    live weights (thread CPU, median; with a tiny width the stage's bookkeeping dominates)."""
    torch.set_num_threads(1)
    mods = nn.Sequential(*(m for _ in range(blocks) for m in (nn.Linear(width, width), nn.ReLU())))
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



def add_variant_args(ap: argparse.ArgumentParser) -> None:
    """The model, the timed run and the ringpipe schedules to compare (both breakdowns of pipeline_breakdown.py)."""
    add_model_args(ap)
    add_run_args(ap)
    ap.add_argument("--variants", default="1f1b,async", help="comma-separated ringpipe schedules")
    add_backend_args(ap)


def run_variants(args: argparse.Namespace, worker: Callable[..., Any], unit: str) -> tuple[list[str], list[Any]]:
    """Choose the split, run ``worker(comm, args, names)`` on 2 ranks, print the run's header; return names, results."""
    names = [v.strip() for v in args.variants.split(",")]
    check_backend_args(args)
    load = os.getloadavg()[0]
    args.first_blocks, args.stage_ms, args.balance_how = choose_split(args)
    print(split_line(args), flush=True)
    res = run_two_ranks(args, worker, (args, names))
    print(f"# {backend_line(args)}; {os.cpu_count()} cores, load average {load:.2f} -> {os.getloadavg()[0]:.2f}; width {args.width}, "
          f"{args.blocks} blocks + head, batch {args.batch}, {args.microbatches} micro-batches, {args.steps} steps, "
          f"medians of {args.repeats} blocks{unit}")
    return names, res

def timeline_report(args: argparse.Namespace, names: list[str], res: list[Any]) -> None:
    """Print the per-rank breakdown of each schedule's step, its CPU per micro-batch and the bounds."""
    print("| schedule | rank | wall | F | B | S | waiting | recv | send | other | after last action |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in names:
        per_block = [breakdown([res[r][n][b] for r in range(2)], args.steps) for b in range(args.repeats)]
        for r in range(2):
            med = {k: statistics.median(pb[r][k] for pb in per_block) for k in per_block[0][r]}
            print(f"| {n} | {r} | {med['wall']:.1f} | {med['F']:.1f} | {med['B']:.1f} | {med['S']:.1f} | "
                  f"{med['wait']:.1f} | {med['recv']:.1f} | {med['send']:.1f} | "
                  f"{med['other']:.1f} | {med['tail']:.1f} |")
    m = args.microbatches
    print(f"\nCPU per micro-batch (ms, thread CPU time; medians of {args.repeats} blocks): F, B, S = its share "
          "of the step, msg = send/receive calls, other = the rest of the main thread, threads = other "
          "threads (gloo I/O), idle = main thread off CPU (waiting, or preempted under load)")
    print("| schedule | rank | F | B | S | msg | other | threads | idle | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    costs: dict[str, list[dict[str, float]]] = {}
    for n in names:
        costs[n] = []
        for r in range(2):
            per_block = [cpu_profile(res[r][n][b], args.steps, m) for b in range(args.repeats)]
            med = {k: statistics.median(pb[k] for pb in per_block) for k in per_block[0]}
            walls = [1e3 * (res[r][n][b]["end"] - res[r][n][b]["start"]) / (args.steps * m) for b in range(args.repeats)]
            costs[n].append(med)
            print(f"| {n} | {r} | {med['F']:.2f} | {med['B']:.2f} | {med['S']:.2f} | {med['msg']:.2f} | "
                  f"{med['other']:.2f} | {med['threads']:.2f} | {med['idle']:.2f} | {statistics.median(walls):.2f} |")
    if "1f1b" in costs and "async" in costs:
        base = costs["1f1b"]  # the same compute for both: the flush is the only difference the bound shows
        for lat in (0.0, 0.25):
            pr = predict(base, m, args.steps, latency=lat)
            print(f"# from 1f1b's measured per-stage costs, message latency {lat} ms: 1f1b {pr['1f1b']:.1f} ms/step, "
                  f"async {pr['async']:.1f} ms/step, bound async/1f1b {pr['1f1b'] / pr['async']:.3f}x")
        bare = [{**c, "msg": 0.0, "other": 0.0} for c in base]
        pr = predict(bare, m, args.steps)
        print(f"# compute alone (F, B, S; no message or bookkeeping CPU): 1f1b {pr['1f1b']:.1f} ms/step, "
              f"async {pr['async']:.1f} ms/step, bound async/1f1b {pr['1f1b'] / pr['async']:.3f}x")
        pa = predict(costs["async"], m, args.steps)
        print(f"# from async's own measured costs: async {pa['async']:.1f} ms/step (stage CPU bound; "
              "the measured wall time above includes waiting and preemption)")
    if getattr(args, "check_bookkeeping", False):
        for width, rows in ((8, 4), (args.width, args.batch // args.microbatches)):
            bk = bookkeeping(width, rows)
            print(f"# forward+backward of one micro-batch ({rows}x{width}), thread CPU us: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in bk.items()))

