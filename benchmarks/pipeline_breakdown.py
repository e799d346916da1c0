"""Where a pipeline step's time goes, per rank: by profile (CPU per micro-batch by kind) or by timeline (stamped actions).

    python benchmarks/pipeline_breakdown.py --by profile --steps 20 --repeats 5
    python benchmarks/pipeline_breakdown.py --by timeline --steps 20 --repeats 5 [--check-bookkeeping]
    python benchmarks/pipeline_breakdown.py --quick          # seconds: both, a tiny model

``--by timeline`` (was ``pipeline_timeline.py``): see :mod:`lib.pipeline.timeline`: every forward,
backward and optimizer step stamped with the monotonic clock; per rank, the gap before each
action split into waiting for the neighbour and overhead, the CPU per micro-batch, and the bound
that 1F1B and the asynchronous stream can at best reach on this split.

``--by profile`` (the default; was ``pipeline_profile.py``): one rank's time in an asynchronous
step and in a 1F1B step, side by side (2 ranks). Runs ringpipe's ``1f1b`` and ``async_1f1b`` schedules on the model and split of
``pipeline_vs_torch.py`` (same options; a split chosen from each block's measured cost by
default) and, per rank and per micro-batch, splits the main thread's time into:

- compute: the stage's forward and backward (``StageRuntime.forward`` / ``backward``, which
  include the asynchronous stage's live-weight hooks and the buffer renewal), and the
  optimizer step's share (``PipelineExecutor.step``);
- message calls: receives (``get``, split into the CPU of the call and the time it waited),
  posting receives ahead (``prefetch``) and sends (``send``);
- the executor's other work (the main thread's CPU outside all of the above: the action loop,
  the data and weight callbacks, bookkeeping per micro-batch);
- Python's garbage collector (``gc.callbacks``: collections and their wall time);
- the other threads of the process (gloo's I/O loop, by thread name from ``/proc``): on a
  machine with as many cores as compute processes they compete with the compute for a core,
  and a schedule without bubbles has no idle time to hide them in;
- idle: the wall time the main thread was off CPU (waiting for a neighbour, or preempted).

Counts and CPU per call are what a loaded machine disturbs least (a preempted thread is not
charged for the time it does not run); wall times and idle are what the load distorts most.
A second pass runs each variant under ``cProfile`` and lists the Python functions with the
most own time (calls per micro-batch and microseconds per call), to find bookkeeping per
micro-batch. The variants run in blocks, alternating their order; figures are medians over
blocks.

    python benchmarks/pipeline_breakdown.py --by profile --steps 20 --repeats 5
    python benchmarks/pipeline_breakdown.py --by profile --bookkeeping   # the live-weight hooks' cost per micro-batch
    python benchmarks/pipeline_breakdown.py --by profile --backend mpi --steps 20 --repeats 5   # over MPI: no I/O thread

Over MPI (``--backend mpi``, ``lib/pipeline/ranks.py``) the row of gloo's I/O thread reads 0, and the
receive calls' CPU includes Open MPI's busy-polling while the message is not in yet (with
``--mca mpi_yield_when_idle=1`` too: the loop yields the core but still polls), so it is the
time the receive waited rather than work; the bounds leave it out there.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ringpipe.pipeline import PipelineTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import report  # noqa: E402
from lib.pipeline import timeline  # noqa: E402
from lib.pipeline.model import Split, data, make_layers, quick  # noqa: E402
from lib.pipeline.timeline import add_variant_args, bookkeeping, predict, run_variants, threads_cpu  # noqa: E402

__all__ = ["by_profile", "main", "profile_run"]

IO_THREAD = "thread gloo_tcp_loop"  # gloo's I/O loop, by its thread name; always a row (0 over MPI)

ROWS = [  # key, label
    ("F", "forward (compute + hooks)"),
    ("B", "backward (compute + hooks)"),
    ("S", "optimizer step (share)"),
    ("get_cpu", "receive calls, CPU"),
    ("get_wait", "receive calls, waiting (wall - CPU)"),
    ("prefetch", "posting receives ahead"),
    ("send", "send calls"),
    ("other", "executor, other main-thread CPU"),
    ("gc", "garbage collector (wall)"),
    ("threads", "other threads' CPU (gloo's I/O loop; over MPI, Open MPI's helpers)"),
    ("idle", "main thread off CPU (wall - CPU)"),
    ("wall", "wall per micro-batch"),
]


class Spans:
    """Thread CPU and wall seconds spent in wrapped calls, by name, with call counts."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.depth = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        spans = self

        def call(*a: Any, **k: Any) -> Any:
            if spans.depth:  # a call inside a wrapped call (get -> prefetch) counts for the outer one
                return fn(*a, **k)
            spans.depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spans.cpu[name] = spans.cpu.get(name, 0.0) + time.thread_time() - c0
                spans.wall[name] = spans.wall.get(name, 0.0) + time.perf_counter() - t0
                spans.calls[name] = spans.calls.get(name, 0) + 1
                spans.depth -= 1
        return call


class GcClock:
    """Wall seconds and count of the garbage collector's runs (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds, self.count, self._t0 = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1


def build(comm: Any, args: argparse.Namespace, schedule: str) -> tuple[PipelineTrainer, Callable[[int], None]]:
    layers = make_layers(args.width, args.blocks)
    is_async = schedule == "async"
    t = PipelineTrainer(
        comm, layers, balance=Split.make(len(layers), args.blocks, "flat", args.first_blocks).balance(),
        schedule=schedule, microbatches=args.microbatches, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01),
        loss_fn=nn.functional.cross_entropy, step_every=args.microbatches if is_async else 1,
    )
    x, y = data(args)
    feed = (x if t.is_first else None, y if t.is_last else None)

    def steps(n: int) -> None:  # as pipeline_vs_torch.py runs them: one stream, or one call per step
        if is_async:
            t.train_stream((feed for _ in range(n)), n)
        else:
            for _ in range(n):
                t.train_step(*feed)

    return t, steps


def instrument(t: PipelineTrainer, spans: Spans) -> None:
    rt, ex = t.runtime, t.executor
    rt.forward = spans.wrap("F", rt.forward)  # type: ignore[method-assign]
    rt.backward = spans.wrap("B", rt.backward)  # type: ignore[method-assign]
    ex.step = spans.wrap("S", ex.step)  # type: ignore[method-assign]
    for ch in (ex.act_in, ex.grad_in):
        if ch is not None:
            ch.get = spans.wrap("get", ch.get)  # type: ignore[method-assign]
            ch.prefetch = spans.wrap("prefetch", ch.prefetch)  # type: ignore[method-assign]
    for ch in (ex.act_out, ex.grad_out):
        if ch is not None:
            ch.send = spans.wrap("send", ch.send)  # type: ignore[method-assign]


def profile_run(comm: Any, args: argparse.Namespace, schedule: str) -> dict[str, float]:
    """One rank's breakdown (ms per micro-batch) of ``args.steps`` steps after a warm-up."""
    t, steps = build(comm, args, schedule)
    steps(args.warmup)
    spans = Spans()
    instrument(t, spans)
    clock = GcClock()
    gc.callbacks.append(clock)
    comm.barrier()
    try:
        th0 = threads_cpu()
        t0, c0 = time.perf_counter(), time.thread_time()
        steps(args.steps)
        t1, c1 = time.perf_counter(), time.thread_time()
        th1 = threads_cpu()
    finally:
        gc.callbacks.remove(clock)
    comm.barrier()
    main_tid = f":{__import__('threading').get_native_id()}"
    others = sum(v - th0.get(k, 0.0) for k, v in th1.items() if not k.endswith(main_tid))
    by_name: dict[str, float] = {}
    for k, v in th1.items():
        if not k.endswith(main_tid) and v > th0.get(k, 0.0):
            name = "thread " + k.rpartition(":")[0]
            by_name[name] = by_name.get(name, 0.0) + v - th0.get(k, 0.0)
    n = args.steps * args.microbatches
    ms = 1e3 / n
    out = {k: spans.cpu.get(k, 0.0) * ms for k in ("F", "B", "S", "prefetch", "send")}
    out["get_cpu"] = spans.cpu.get("get", 0.0) * ms
    out["get_wait"] = (spans.wall.get("get", 0.0) - spans.cpu.get("get", 0.0)) * ms
    out["other"] = (c1 - c0 - sum(spans.cpu.values())) * ms
    out["gc"] = clock.seconds * ms
    out["gc_runs"] = clock.count / n
    out["threads"] = others * ms
    out["idle"] = (t1 - t0 - (c1 - c0)) * ms
    out["wall"] = (t1 - t0) * ms
    out["calls_per_mb"] = sum(spans.calls.values()) / n
    out.update({k: v * ms for k, v in by_name.items()})
    return out


def cprofile_run(comm: Any, args: argparse.Namespace, schedule: str, top: int) -> list[tuple[str, float, float, float]]:
    """The Python functions with the most own time: (name, calls per micro-batch, us per call, own ms per micro-batch)."""
    t, steps = build(comm, args, schedule)
    steps(args.warmup)
    comm.barrier()
    prof = cProfile.Profile(time.thread_time_ns, 1e-9)  # CPU time: what the load disturbs least
    prof.runcall(steps, args.steps)
    comm.barrier()
    n = args.steps * args.microbatches
    st = pstats.Stats(prof)
    rows = []
    for (path, line, fn), (_cc, nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(path)}:{line}({fn})" if line else fn
        rows.append((where, nc / n, 1e6 * tt / max(nc, 1), 1e3 * tt / n))
    rows.sort(key=lambda r: -r[3])
    return rows[:top]


def worker(comm: Any, args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {n: [] for n in names}
    for block in range(args.repeats):
        for n in names if block % 2 == 0 else names[::-1]:
            out[n].append(profile_run(comm, args, n))
    out["cprofile"] = {n: cprofile_run(comm, args, n, args.top) for n in names} if args.top else {}
    return out


def bounds(args: argparse.Namespace, med: dict[tuple[str, int], dict[str, float]], res: Any) -> None:
    """async / 1F1B: measured (median of per-block wall ratios) against what the measured CPU allows.

    The schedules' bound (``lib.pipeline.timeline.predict``: each stage busy with exactly its
    measured main-thread CPU per action, the same for both schedules, messages free) leaves the other threads out: 1F1B's
    bubble gives them an idle core. The asynchronous stream has no bubble, so on a machine with
    as many cores as stages its step also needs the CPU of every thread of both ranks shared
    over the cores: the second bound.
    """
    m, cores = args.microbatches, os.cpu_count() or 1
    # Over MPI a receive busy-polls until its message is in: its CPU is mostly waiting, not work
    # (1F1B spins through its bubble), so the bounds leave it out there (the copy it includes is
    # small: 256 KiB through shared memory).
    spin = getattr(args, "backend", "gloo") == "mpi"

    def cost(n: str, r: int) -> dict[str, float]:
        c = med[(n, r)]
        recv = 0.0 if spin else c["get_cpu"]
        return {"F": c["F"], "B": c["B"], "S": c["S"], "msg": recv + c["prefetch"] + c["send"], "other": c["other"]}

    # the same work in both schedules: each action's cost is the mean of the two variants' medians
    both = [{k: (cost("1f1b", r)[k] + cost("async", r)[k]) / 2 for k in cost("1f1b", r)} for r in range(2)]
    pr = predict(both, m, args.steps)
    sync, stream = pr["1f1b"], pr["async"]
    every = sum(sum(both[r].values()) + med[("async", r)]["threads"] for r in range(2))
    machine = max(stream, m * every / cores)
    walls = [res[0]["1f1b"][b]["wall"] / res[0]["async"][b]["wall"] for b in range(args.repeats)]
    print(f"\n# from the measured main-thread CPU per action (mean of both variants): 1f1b {sync:.1f} ms/step, "
          f"async {stream:.1f} ms/step "
          f"(bound {sync / stream:.3f}x); with every thread's CPU of both ranks shared over {cores} cores: "
          f"{machine:.1f} ms/step (bound {sync / machine:.3f}x)")
    if spin:
        print("# over MPI the receive calls' CPU (busy-polling while waiting) is left out of both bounds")
    print(f"# measured async / 1f1b (wall, median of per-block ratios): {statistics.median(walls):.3f}x "
          f"(range {min(walls):.3f}-{max(walls):.3f}); load average now {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--by", choices=("profile", "timeline"), default="profile")
    add_variant_args(ap)
    ap.add_argument("--top", type=int, default=12,
                    help="profile: Python functions listed per rank from cProfile (0: no cProfile pass)")
    ap.add_argument("--bookkeeping", action="store_true",
                    help="profile: only time, in this process, forward + backward of a 16-block stage of width 8 "
                         "(bookkeeping dominates) plain and with the asynchronous stage's live-weight hooks")
    ap.add_argument("--check-bookkeeping", action="store_true",
                    help="timeline: also time forward + backward with and without the live-weight hooks")
    ap.add_argument("--quick", action="store_true", help="seconds: both breakdowns on a tiny model, one block")
    args = ap.parse_args(argv)
    report.header("pipeline_breakdown", argv)
    if args.quick:
        quick(args)
        args.top = 3
        names, res = run_variants(args, timeline.worker, ", ms per step")
        timeline.timeline_report(args, names, res)
        by_profile(args)
    elif args.by == "timeline":
        names, res = run_variants(args, timeline.worker, ", ms per step")
        timeline.timeline_report(args, names, res)
    else:
        by_profile(args)
    report.footer()
    return 0


def by_profile(args: argparse.Namespace) -> None:
    """The profile breakdown: CPU per micro-batch by kind, per rank and schedule, and the bounds."""
    if args.bookkeeping:
        for _ in range(3):
            bk = bookkeeping(8, 4, reps=2000, blocks=16)
            print("# forward+backward of one micro-batch, 16 blocks of width 8, thread CPU us (median of 2000): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in bk.items()) + f"; hooks {bk['live_weights'] - bk['plain']:.0f}")
        return
    names, res = run_variants(args, worker, "; ms per micro-batch (thread CPU unless marked wall)")
    cols = [(n, r) for n in names for r in range(2)]
    print("| | " + " | ".join(f"{n} rank {r}" for n, r in cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    med = {(n, r): {k: statistics.median(b.get(k, 0.0) for b in res[r][n]) for k in set().union(*res[r][n])}
           for n, r in cols}
    for key, label in ROWS:
        print(f"| {label} | " + " | ".join(f"{med[c][key]:.3f}" for c in cols) + " |")
    print("| compute (F + B + S) | " + " | ".join(f"{med[c]['F'] + med[c]['B'] + med[c]['S']:.3f}" for c in cols) + " |")
    print("| all but compute, main thread CPU | " + " | ".join(
        f"{med[c]['get_cpu'] + med[c]['prefetch'] + med[c]['send'] + med[c]['other']:.3f}" for c in cols) + " |")
    print("| gc runs per micro-batch | " + " | ".join(f"{med[c]['gc_runs']:.2f}" for c in cols) + " |")
    for key in sorted({k for c in cols for k in med[c] if k.startswith("thread ")} | {IO_THREAD}):
        print(f"| {key} | " + " | ".join(f"{med[c].get(key, 0.0):.3f}" for c in cols) + " |")
    print("| wrapped calls per micro-batch | " + " | ".join(f"{med[c]['calls_per_mb']:.1f}" for c in cols) + " |")
    if {"1f1b", "async"} <= set(names):
        bounds(args, med, res)
    if args.top:
        for n in names:
            for r in range(2):
                print(f"\n## cProfile, {n}, rank {r}: own time (calls per micro-batch, us per call, ms per micro-batch)")
                for where, calls, us, own in res[r]["cprofile"][n]:
                    print(f"- {where}: {calls:.1f} calls, {us:.1f} us, {own:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
