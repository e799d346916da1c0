"""Pipeline throughput and activation memory: ringpipe's schedules against torch.distributed.pipelining, 2 ranks.

Both systems get their stages from ONE :class:`Split` of one list of layers (an MLP of
``--blocks`` Linear+ReLU blocks and a Linear head, built with the same seed): the split says
which layers form each model chunk and which rank holds each chunk. Two-stage schedules use
one chunk per rank; interleaved and V-shaped ones cut the same per-rank layers into two chunks
per rank. Where the cut between the ranks falls is chosen from measurement (``--balance
measured``, the default): each block's forward + backward of one micro-batch is timed before the
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
(``schedule_timing.py``: F = 1, B = 2, I = W = 1 per stage), and the time per step they imply
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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ringpipe.pipeline.stage as stage_mod
from ringpipe.launch import spawn
from ringpipe.pipeline import PipelineTrainer
from ringpipe.pipeline.schedules import SCHEDULES, async_1f1b, get_schedule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schedule_timing import Op, ringpipe_ops, simulate  # noqa: E402

__all__ = ["Split", "add_model_args", "choose_split", "main", "split_line"]

TORCH_SCHEDULES = {  # name -> (class name, chunk layout)
    "gpipe": ("ScheduleGPipe", "flat"),
    "1f1b": ("Schedule1F1B", "flat"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
}
RINGPIPE_SYNC = ["seq", "gpipe", "1f1b"]
RINGPIPE_NEW = {"interleaved_1f1b": "loop", "zb_h1": "flat", "zb_h2": "flat"}  # run when the installed ringpipe registers them


def make_layers(width: int, blocks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(blocks):
        out += [nn.Linear(width, width), nn.ReLU()]
    out.append(nn.Linear(width, 10))
    return out


@dataclass(frozen=True)
class Split:
    """Which layers form each chunk and which rank holds it; one object for both systems."""

    chunks: tuple[tuple[int, ...], ...]
    ranks: tuple[int, ...]

    @classmethod
    def make(cls, num_layers: int, blocks: int, layout: str, first: int | None = None) -> Split:
        """``first`` blocks on one rank, the other blocks and the head on the other (half each by default).

        ``flat``: one chunk a rank, rank 0 the first ``first`` blocks. ``loop`` (ranks 0, 1, 0, 1)
        and ``v`` (0, 1, 1, 0): each rank's blocks cut into two chunks, so every rank holds the
        same work as in ``flat`` (in ``v`` rank 0 holds the head, hence the other share).
        """
        first = blocks // 2 if first is None else first
        rest = blocks - first
        low = 1 if layout == "flat" else 2
        if not (first >= low and rest >= low):
            raise SystemExit(f"--blocks {blocks} split {first} | {rest}: every rank needs at least {low} "
                             f"block(s) for layout {layout!r}; use more blocks or another --balance")
        per = [list(range(2 * b, 2 * b + 2)) for b in range(blocks)]
        per[-1].append(num_layers - 1)
        if layout == "flat":
            sizes, order = [first, rest], (0, 1)
        else:
            order = {"loop": (0, 1, 0, 1), "v": (0, 1, 1, 0)}[layout]
            share = {0: first, 1: rest} if layout == "loop" else {0: rest, 1: first}  # head's rank: rest
            halves = {r: [(n + 1) // 2, n // 2] for r, n in share.items()}
            sizes = [halves[r].pop(0) for r in order]
        chunks, start = [], 0
        for n in sizes:
            chunks.append(tuple(sum(per[start:start + n], [])))
            start += n
        return cls(tuple(chunks), order)

    def chunks_of(self, rank: int) -> list[int]:
        return [c for c, r in enumerate(self.ranks) if r == rank]

    def balance(self) -> list[int]:
        return [len(c) for c in self.chunks]


class Loss(nn.Module):
    """The loss as a layer, so that the split's timing counts it with the last block."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(x, self.target)


def choose_split(args: argparse.Namespace) -> tuple[int, list[float], str]:
    """Blocks on the first rank, the two stages' measured ms per micro-batch, and how it was chosen.

    ``--balance measured``: each block's forward + backward of one micro-batch is timed once
    (thread CPU, one thread as in the run, ringpipe's :func:`layer_times`: the first block
    without the input gradient the first stage never computes, the head and the loss counted
    with the last block) and ringpipe's exact splitter picks the cut that minimises the slower
    stage. ``--balance A,B``: layers per rank (a cut between blocks), timed the same way.
    """
    from ringpipe.pipeline.partition import balance_by_size, layer_times

    layers = make_layers(args.width, args.blocks)
    n = len(layers)
    x, y = data(args)
    rows = args.batch // args.microbatches
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer_times(layers[:2], x[:rows], repeats=3, clock=time.thread_time)  # warm the allocator
        t = layer_times(layers + [Loss(y[:rows])], x[:rows], repeats=args.balance_repeats, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    block = [t[2 * b] + t[2 * b + 1] for b in range(args.blocks)]
    block[-1] += t[n - 1] + t[n]  # head and loss
    if args.balance == "measured":
        first, how = balance_by_size(block, 2)[0], "measured"
    else:
        try:
            bal = [int(v) for v in args.balance.split(",")]
        except ValueError:
            raise SystemExit(f"--balance {args.balance!r}: give 'measured' or two layer counts like 4,5") from None
        if len(bal) != 2 or sum(bal) != n or bal[0] % 2 or bal[0] < 2:
            raise SystemExit(f"--balance {args.balance}: give two layer counts adding up to {n} (the model's "
                             f"layers) whose first is an even number >= 2 (a cut between Linear+ReLU blocks), "
                             f"e.g. {args.blocks},{args.blocks + 1}")
        first, how = bal[0] // 2, "given"
    stage = [1e3 * sum(block[:first]), 1e3 * sum(block[first:])]
    return first, stage, how


def describe(stage_modules: Sequence[nn.Module], layers: list[nn.Module]) -> dict[str, Any]:
    """Parameter count and the global indices of the layers a rank's stages really hold."""
    index = {id(m): i for i, m in enumerate(layers)}
    held = [index[id(m)] for s in stage_modules for m in s.modules() if id(m) in index]
    params = sum(p.numel() for s in stage_modules for p in s.parameters())
    kinds = sorted(f"{type(layers[i]).__name__}{tuple(p.shape for p in layers[i].parameters())}" for i in held)
    return {"params": params, "layers": held, "kinds": kinds}


class ActivationMeter:
    """Peak live bytes of tensors autograd saves (parameters excluded), plus ringpipe's kept inputs."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.weights = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.kept = self.peak = 0
        self.refs: dict[int, int] = {}  # storage -> saved tensors holding it (a storage counts once)

    def pack(self, t: torch.Tensor, inner: Any = None) -> Any:
        meter = self
        ptr = t.untyped_storage().data_ptr()
        n = 0 if ptr in self.weights else t.untyped_storage().nbytes()

        class Held:
            __slots__ = ("v",)

            def __init__(self, v: Any) -> None:
                self.v = v
                meter.refs[ptr] = meter.refs.get(ptr, 0) + 1
                if meter.refs[ptr] == 1:
                    meter.live += n
                    meter.peak = max(meter.peak, meter.live + meter.kept)

            def __del__(self) -> None:
                meter.refs[ptr] -= 1
                if not meter.refs[ptr]:
                    del meter.refs[ptr]
                    meter.live -= n

        # A saved *output* held as itself would close a cycle through its own grad_fn (node ->
        # saved hook object -> tensor -> node) that Python's collector cannot see: a node that no
        # backward ever executes (zero-bubble weight passes skip the activation nodes) would then
        # never be freed. A detached alias holds the same storage without the cycle.
        return Held(t.detach() if inner is None else inner(t))

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda h: h.v)

    def nested(self, factory: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
        """Wrap ringpipe's own saved-tensors hooks (asynchronous stages) so they are counted too."""
        def make(module: nn.Module) -> Any:
            inner = factory(module)
            return torch.autograd.graph.saved_tensors_hooks(
                lambda t: self.pack(t, inner.pack_hook), lambda h: inner.unpack_hook(h.v))
        return make


def data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)


def timed(comm: Any, warmup: Callable[[], None], work: Callable[[], None]) -> tuple[float, float]:
    """Wall-clock seconds of ``work`` between two barriers, and this process's CPU seconds in it."""
    warmup()
    comm.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    work()
    c1 = time.process_time()
    comm.barrier()
    return time.perf_counter() - t0, c1 - c0


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


def cpu_timed(fn: Callable[..., Any], log: dict[str, list[float]], key: str) -> Callable[..., Any]:
    """``fn``, appending the thread CPU seconds of each call to ``log[key]``."""
    def call(*a: Any, **k: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            log.setdefault(key, []).append(time.thread_time() - c0)
    return call


def medians(log: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in log.items() if v}


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


def variants(args: argparse.Namespace, torch_ok: Sequence[str]) -> dict[str, Callable[[Any], dict[str, Any]]]:
    out: dict[str, Callable[[Any], dict[str, Any]]] = {}
    for s in RINGPIPE_SYNC + [n for n in RINGPIPE_NEW if n in SCHEDULES]:
        out[f"ringpipe {s}"] = lambda c, s=s: ringpipe_run(c, args, s)
    out["ringpipe async_1f1b"] = lambda c: ringpipe_run(c, args, "async")
    for s in ("gpipe", "1f1b"):
        out[f"ringpipe {s}+recompute"] = lambda c, s=s: ringpipe_run(c, args, s, True)
    for s in torch_ok:
        out[f"torch {s}"] = lambda c, s=s: torch_run(c, args, s)
    return out


def worker(comm: Any, args: argparse.Namespace, torch_ok: Sequence[str], only: Sequence[str] | None) -> dict[str, list[dict]]:
    torch.set_num_threads(1)
    table = variants(args, torch_ok)
    names = list(only) if only else list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; valid: {sorted(table)}")
    out: dict[str, list[dict]] = {n: [] for n in names}
    for block in range(args.repeats):
        k = block % len(names)
        for n in names[k:] + names[:k]:  # rotated so no variant always runs first or after the same one
            if args.profile:
                import cProfile

                prof = cProfile.Profile()
                out[n].append(prof.runcall(table[n], comm))
                prof.dump_stats(os.path.join(args.profile, f"{n.replace(' ', '_')}.rank{comm.rank}.prof"))
            else:
                out[n].append(table[n](comm))
    return out


def probe_torch(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Which torch schedules run here (a failing one would leave its peer waiting in the real run)."""
    small = argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0, "repeats": 1, "profile": None})
    ok, failed = [], {}
    for name in TORCH_SCHEDULES:
        try:
            spawn(worker, 2, args=(small, [name], [f"torch {name}"]), env={"OMP_NUM_THREADS": "1"})
            ok.append(name)
        except Exception as exc:  # noqa: BLE001 - report any failure of torch's schedule, then go on
            failed[name] = " ".join(str(exc).split())[:300]
    return ok, failed


def theory(args: argparse.Namespace, r0: dict[str, list[dict]], r1: dict[str, list[dict]]) -> dict[str, tuple[float, float, float, float]]:
    """Per variant: the bubble fraction of one step alone (async: of the whole stream), the time
    per step per micro-batch in the steady state of consecutive steps (units of one stage's
    forward of a micro-batch; async: the stream's mean), both with F = 1, B = 2, I = W = 1 per
    stage, the ms per step the schedule implies with the variant's own measured CPU costs per
    chunk and kind of action (medians over blocks of the median call; messages and optimizer step
    not counted), and the steady-state bubble ``1 - ideal / time per step`` (ideal: a rank's
    compute per micro-batch)."""
    m, t = args.microbatches, args.steps
    out: dict[str, tuple[float, float, float, float]] = {}
    for name, reps in r0.items():
        sched = name.split()[1].split("+")[0]
        costs: dict[tuple[int, str], float] = {}
        for res in (r0, r1):
            keys = {k for rep in res[name] for k in rep.get("costs", {})}
            for k in keys:
                chunk, kind = k.split(":")
                costs[(int(chunk), kind)] = 1e3 * statistics.median(
                    rep["costs"][k] for rep in res[name] if k in rep.get("costs", {}))
        if name.startswith("torch"):
            per = {r: [Op(*o) for o in res[name][0]["ops"]] for r, res in enumerate((r0, r1))}
            kw: dict[str, Any] = {"num_chunks": reps[0]["chunks"], "chunks_per_rank": reps[0]["chunks"] // 2}
            steps = 1
        elif sched == "async_1f1b":
            per = ringpipe_ops([async_1f1b(2, m * t, s, m) for s in range(2)])
            kw, steps = {"num_chunks": 2}, t
        elif sched == "interleaved_1f1b":
            per = ringpipe_ops([get_schedule(sched)(2, m, s, 2) for s in range(2)])
            kw, steps = {"num_chunks": 4, "chunks_per_rank": 2}, 1
        else:
            per = ringpipe_ops([get_schedule(sched)(2, m, s) for s in range(2)])
            kw, steps = {"num_chunks": 2}, 1
        tm = simulate(per, **kw)
        if steps == 1:  # consecutive steps: a rank starts the next one when it is done (no barrier)
            unit = steady(per, m, kw)
            measured = steady(per, m, kw, costs) if costs else float("nan")
        else:
            unit = tm.makespan / steps
            measured = simulate(per, **kw, costs=costs).makespan / steps if costs else float("nan")
        ideal = tm.busy / (tm.ranks * steps * m)  # a rank's compute per micro-batch: 3 units
        out[name] = (tm.bubble, unit / m, measured, 1.0 - ideal / (unit / m))
    return out


def steady(per: dict[int, list[Op]], m: int, kw: dict[str, Any], costs: Any = None) -> float:
    """Time one more step adds to a run of consecutive steps of one step's ops (the steady state).

    A rank takes its optimizer step on its own and goes on with the next step's actions (both
    systems: no barrier between steps), so a schedule whose first rank finishes before the last
    (ZB-H2's parallelogram, V shapes) overlaps the next step's start with this step's end.
    """
    def tiled(k: int) -> dict[int, list[Op]]:
        return {r: [Op(o.chunk, o.kind, o.mb + i * m) for i in range(k) for o in ops] for r, ops in per.items()}
    return simulate(tiled(4), **kw, costs=costs).makespan - simulate(tiled(3), **kw, costs=costs).makespan


def split_line(args: argparse.Namespace) -> str:
    a, b = args.stage_ms
    return (f"# split ({args.balance_how}): rank 0 blocks 0-{args.first_blocks - 1} | rank 1 blocks "
            f"{args.first_blocks}-{args.blocks - 1} + head + loss (layers per rank {2 * args.first_blocks},"
            f"{2 * (args.blocks - args.first_blocks) + 1}); timed before the run, forward+backward of one "
            f"micro-batch, thread CPU: stage 0 {a:.2f} ms, stage 1 {b:.2f} ms (slower / faster {max(a, b) / min(a, b):.3f})")


def stage_cost(reps: list[dict]) -> float:
    """A rank's compute per micro-batch in the run: the sum over its chunks and kinds of the median call
    (median over blocks), the same figure for ringpipe and torch."""
    return 1e3 * statistics.median(sum(r.get("costs", {}).values()) for r in reps)


def report(args: argparse.Namespace, r0: dict[str, list[dict]], r1: dict[str, list[dict]],
           failed: dict[str, str]) -> None:
    load = os.getloadavg()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"gloo, 2 processes x 1 thread; load average before/after {args.load_before} / {load[0]:.2f}")
    print(f"# MLP width {args.width}, {args.blocks} blocks + head, batch {args.batch}, {args.microbatches} "
          f"micro-batches, SGD, {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} blocks")
    print(split_line(args))
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

    def ratio(a: str, b: str) -> str:
        if not (equal[a] and equal[b]):
            return f"{a} / {b}: REFUSED, the ranks do not hold the same layers and parameters"
        per_block = [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(r0[a], r0[b], strict=True)]
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


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model, batch and split options, shared with ``pipeline_timeline.py``."""
    ap.add_argument("--width", type=int, default=362)
    ap.add_argument("--blocks", type=int, default=32,
                    help="Linear+ReLU blocks in all (32 of width 362: the multiply-adds of 4 blocks of 1024)")
    ap.add_argument("--balance", default="measured",
                    help="'measured' (time each block, cut where the two stages cost most nearly the same) "
                         "or layers per rank, e.g. 4,5 for 2 blocks | 2 blocks + head")
    ap.add_argument("--balance-repeats", type=int, default=31, help="passes over the layers to time the split (median)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)



def add_run_args(ap: argparse.ArgumentParser) -> None:
    """Steps, warm-up and blocks of a timed run, alike in every pipeline benchmark."""
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="blocks: every variant runs once per block")

def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Columns 'bubble, one step': idle share of one step run alone (async: of the whole stream of\n"
               "--steps steps). 'bubble, steady state': 1 - ideal / time per step, with time per step the\n"
               "steady state of consecutive steps in units per micro-batch (async: the stream's mean) and\n"
               "ideal a rank's compute per micro-batch (F + B = 3 units). Both from the schedules' action lists.")
    add_model_args(ap)
    add_run_args(ap)
    ap.add_argument("--only", help="comma-separated variants to run (e.g. 'ringpipe async_1f1b,ringpipe 1f1b')")
    ap.add_argument("--profile", metavar="DIR", help="write each rank's cProfile statistics of each run to DIR")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.load_before = f"{os.getloadavg()[0]:.2f}"
    args.first_blocks, args.stage_ms, args.balance_how = choose_split(args)
    print(split_line(args), file=sys.stderr, flush=True)  # early: the run takes minutes
    env = {"OMP_NUM_THREADS": "1"}
    only = [v.strip() for v in args.only.split(",")] if args.only else None
    if only:
        ok, failed = [v.split()[1] for v in only if v.startswith("torch ")], {}
    else:
        ok, failed = probe_torch(args)
    r0, r1 = spawn(worker, 2, args=(args, ok, only), env=env)
    if args.json:
        print(json.dumps({"rank0": r0, "rank1": r1, "failed": failed}, default=str))
        return
    report(args, r0, r1, failed)


if __name__ == "__main__":
    main()
