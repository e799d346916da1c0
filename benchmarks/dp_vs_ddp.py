"""Step time of ringpipe's DistributedOptimizer against torch DDP and against the compute-only bound.

    python benchmarks/dp_vs_ddp.py                                  # every model, 2 ranks, fp32, 5 runs
    python benchmarks/dp_vs_ddp.py --models small,mlp --ranks 2,4 --compression none,fp16 --runs 5
    python benchmarks/dp_vs_ddp.py --quick                          # seconds: tiny model, every variant

Every run starts ``--ranks`` real processes (gloo, local launcher, one thread each) that time,
in alternating blocks, one training step (zero_grad, forward, loss, backward, optimizer step,
SGD with momentum) of the same model definition, data and transport in three ways:

- ``bound``: the step with no communication at all (each rank trains alone, on the same
  threads and under the same load as the other variants): what a data-parallel system can at
  best reach;
- ``serial`` (``--serial``): the bound's step plus one blocking allreduce (gloo's, or the
  backend's) of a buffer as large as all gradients, after backward and before the update: the
  transport's own cost with no framework around it, no copies and no overlap. A one-bucket model
  (the small MLP) cannot overlap its reduction with backward, so neither system can be much
  faster than this on it; a system's time over ``serial`` is its own overhead;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (with ``--compression fp16``, its
  ``fp16_compress_hook``);
- ``ringpipe``: ``DistributedOptimizer`` with its defaults (join support on, as Horovod),
  ``ringpipe-nojoin`` with ``join_support=False`` (``--nojoin``), ``ringpipe-held`` with
  ``overlap=False``: every bucket held until backward ends (``--held``), and ``ringpipe-whole``
  (``--whole-step``): ``synchronize()``, then ``step()`` inside ``skip_synchronize()`` (Horovod's
  pattern for clipping), so every parameter is updated once after the last reduction instead of
  each bucket's as soon as it is reduced.

Each step is split into forward (+ loss), backward and optimizer step; for ringpipe, the
optimizer's own clock adds gradient copies into the fusion buffers, the time from a bucket
being complete to its task starting, the engine tasks (scaling, casting, posting), the time
``step()`` waited for reductions and the time it spent updating the parameters of buckets already
reduced while later ones were still in flight. The clock runs in steps of its own after each ringpipe block,
so its cost is never in the step times compared with DDP's. A variant's overhead over the bound, per phase, is where its
communication was not hidden. Reported per configuration: the median over runs of each run's
median step time, and the spread (lowest and highest run median).

On a host shared with other jobs, give the ranks the highest CFS weight so that both sides get
the cores alike and other jobs hardly take them: ``nice -n -20 python benchmarks/dp_vs_ddp.py``
(root; the ranks inherit it). Not a real-time class (``chrt -f``): FIFO threads of equal priority
are not time-sliced, so a bucket's task would wait for backward to end instead of overlapping it,
on both sides; that distorts exactly what is measured.

Models (``--models``): ``small`` (the trainer's MLP 64-128-64-10, batch 32), ``mlp``
(1024-2048-2048-2048-10, batch 64), ``resnet`` (ResNet-18: 11.2M parameters, basic blocks
2-2-2-2, ImageNet stem, 32x32 inputs, batch 16) and ``transformer`` (the trainer's: d_model 64,
4 heads, 2 layers, ff 128, vocab 32, sequences of 16, batch 32).

On a GPU host, ``--device cuda`` puts every variant's model and batch on the rank's GPU (its
local rank modulo the GPUs there, so ranks may share one), times each phase up to a device
synchronisation, and gives DDP ``device_ids``; ``--backend nccl`` (one rank per GPU) or ``gloo``
(CUDA tensors over gloo, which lets two ranks share one GPU) picks the transport of both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import models, report, stats, timing  # noqa: E402

__all__ = ["main", "run_ranks", "variants"]

PHASES = ("forward", "backward", "step")
CLOCK = ("copy", "ready_to_sent", "engine", "copy_out", "wait", "bucket_step")


def _steps(variant: dict[str, Any], n: int, clocked: bool = False) -> None:
    """Time ``n`` steps of a variant, appending to its samples.

    Unclocked steps give the step time and its phases; ``clocked`` steps run ringpipe's own clock
    (``DistributedOptimizer.clock``) and give only its columns, so that the clock's own cost is
    never in the step times compared with DDP's.
    """
    model, opt, x, y = variant["model"], variant["opt"], variant["x"], variant["y"]
    dev = x.device
    clock: dict[str, float] | None = {} if clocked else None
    if hasattr(opt, "clock"):
        opt.clock = clock
    s = variant["samples"]
    for _ in range(n):
        if clock is not None:
            clock.clear()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = models.loss(model(x), y)
        models.sync(dev)
        t1 = time.perf_counter()
        loss.backward()
        models.sync(dev)
        t2 = time.perf_counter()
        opt.step()
        models.sync(dev)
        t3 = time.perf_counter()
        if clock is not None:
            for k in CLOCK:
                s.setdefault(k, []).append(clock.get(k, 0.0))
            continue
        s["total"].append(t3 - t0)
        s["forward"].append(t1 - t0)
        s["backward"].append(t2 - t1)
        s["step"].append(t3 - t2)


class _SerialReduce:
    """An optimizer that, before each update, allreduces one preallocated gradient-sized buffer."""

    def __init__(self, opt: torch.optim.Optimizer, numel: int, device: torch.device) -> None:
        self.opt, self.flat = opt, torch.zeros(numel, device=device)

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        dist.all_reduce(self.flat)
        self.opt.step()


class _WholeStep:
    """A DistributedOptimizer stepped as ``synchronize()`` then ``step()`` in ``skip_synchronize()``."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.synchronize()
        with self.opt.skip_synchronize():
            self.opt.step()


#: Variants timed only when asked for, each against ringpipe's defaults in the report: what the
#: median over runs of its step time over ringpipe's says.
AGAINST_DEFAULTS = {
    "ringpipe-held": "Buckets held until backward ends against launched as they fill",
    "ringpipe-whole": "One update after the last reduction against each bucket's as it is reduced",
}


def variants(comm: Any, kind: str, compression: str, nojoin: bool,
              device: torch.device, extras: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """bound, DDP and ringpipe (and ringpipe-nojoin with ``nojoin``), plus the ``extras`` named:
    ``serial``, ``ringpipe-held``, ``ringpipe-whole``."""
    from ringpipe.dp import DistributedOptimizer

    def make_model_on_device(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        model, x, y = models.make_model(kind)
        return model.to(device), x.to(device), y.to(device)

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    out: dict[str, dict[str, Any]] = {}
    model, x, y = make_model_on_device(kind)
    out["bound"] = {"model": model, "opt": sgd(model), "x": x, "y": y}
    if "serial" in extras:
        model, x, y = make_model_on_device(kind)
        numel = sum(p.numel() for p in model.parameters())
        out["serial"] = {"model": model, "opt": _SerialReduce(sgd(model), numel, device), "x": x, "y": y}
    model, x, y = make_model_on_device(kind)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if compression == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out["ddp"] = {"model": ddp, "opt": sgd(ddp), "x": x, "y": y}
    for name, join, overlap in (("ringpipe", True, True), ("ringpipe-nojoin", False, True),
                                ("ringpipe-held", True, False)):
        if (name == "ringpipe-nojoin" and not nojoin) or (name == "ringpipe-held" and name not in extras):
            continue
        model, x, y = make_model_on_device(kind)
        opt = DistributedOptimizer(sgd(model), model.named_parameters(), comm=comm, compression=compression,
                                   join_support=join, overlap=overlap)
        out[name] = {"model": model, "opt": opt, "x": x, "y": y, "clocked": True}
    if "ringpipe-whole" in extras:
        model, x, y = make_model_on_device(kind)
        opt = DistributedOptimizer(sgd(model), model.named_parameters(), comm=comm, compression=compression)
        out["ringpipe-whole"] = {"model": model, "opt": _WholeStep(opt), "x": x, "y": y}
    for v in out.values():
        v["samples"] = {k: [] for k in ("total", *PHASES)}
    return out


def run_ranks(comm: Any, kind: str, compression: str, blocks: int, steps: int, nojoin: bool,
              device_type: str = "cpu", extras: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run on every rank: alternated blocks; per variant the median of each measure (slowest rank)."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", comm.topology.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    built = variants(comm, kind, compression, nojoin, device, extras)
    for v in built.values():
        _steps(v, 3)  # warm-up
        if v.get("clocked"):
            _steps(v, 2, clocked=True)
        v["samples"] = {k: [] for k in v["samples"]}
    names = list(built)
    for block in range(blocks):
        for name in timing.order(names, block):
            comm.barrier()
            _steps(built[name], steps)
            if built[name].get("clocked"):  # its clock's columns, in steps of their own
                comm.barrier()
                _steps(built[name], max(2, steps // 2), clocked=True)
    mine = {name: {k: statistics.median(s) for k, s in v["samples"].items()} for name, v in built.items()}
    for name, v in built.items():  # the spread of single steps: a fast path against stalls
        single = stats.spread(v["samples"]["total"], "p10-p90")
        mine[name]["p10"], mine[name]["p90"] = single.low, single.high
    every = comm.allgather_object(mine)
    slowest = max(every, key=lambda m: m["ringpipe"]["total"])  # one rank's figures, consistent phases
    return {"params": sum(p.numel() for p in built["bound"]["model"].parameters()), "ranks": comm.size,
            "variants": slowest, "per_rank_total": [{n: m[n]["total"] for n in m} for m in every],
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": comm.backend}


def _one_run(kind: str, ranks: int, compression: str, blocks: int, steps: int, nojoin: bool,
             device: str = "cpu", backend: str = "gloo", extras: tuple[str, ...] = ()) -> dict[str, Any]:
    from ringpipe.launch import spawn

    return spawn(run_ranks, ranks, backend=backend,
                 args=(kind, compression, blocks, steps, nojoin, device, extras))[0]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over runs of every variant's measures, and the spread of the step time."""
    out: dict[str, Any] = {"params": runs[0]["params"], "ranks": runs[0]["ranks"], "runs": len(runs), "variants": {},
                           "device": runs[0].get("device", "cpu"), "backend": runs[0].get("backend", "gloo")}
    for name in runs[0]["variants"]:
        keys = runs[0]["variants"][name]
        med = {k: statistics.median(r["variants"][name][k] for r in runs) for k in keys}
        totals = [r["variants"][name]["total"] for r in runs]
        med["min"], med["max"] = min(totals), max(totals)
        out["variants"][name] = med
    ratio = stats.ratios([r["variants"]["ringpipe"]["total"] for r in runs], [r["variants"]["ddp"]["total"] for r in runs])
    out["ratio_median"], out["ratio_min"], out["ratio_max"] = ratio.median, ratio.low, ratio.high
    if "serial" in runs[0]["variants"]:  # each system against the bare transport, run by run
        for name in ("ddp", "ringpipe"):
            r = [run["variants"][name]["total"] / run["variants"]["serial"]["total"] for run in runs]
            out[f"{name}_over_serial"] = (statistics.median(r), min(r), max(r))
    out["against_defaults"] = {}
    for name in AGAINST_DEFAULTS:  # run by run, the variant's step over ringpipe's with its defaults
        if name in runs[0]["variants"]:
            r = [run["variants"][name]["total"] / run["variants"]["ringpipe"]["total"] for run in runs]
            out["against_defaults"][name] = (statistics.median(r), min(r), max(r))
    return out


def _ms(t: float) -> str:
    return f"{t * 1e3:.2f}" if t < 0.1 else f"{t * 1e3:.1f}"


def _names(results: list[tuple[str, int, str, dict[str, Any]]]) -> list[str]:
    """Every variant that ran, in the order of the first configuration that had it."""
    names: list[str] = []
    for *_, s in results:
        names += [n for n in s["variants"] if n not in names]
    return names


def tables(results: list[tuple[str, int, str, dict[str, Any]]]) -> str:
    lines = [
        "| model | params | ranks | wire | bound (ms) | DDP (ms) | ringpipe (ms) | ringpipe / DDP (runs) |"
        " DDP over bound | ringpipe over bound |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for kind, ranks, comp, s in results:
        v = s["variants"]
        b, d, r = v["bound"]["total"], v["ddp"]["total"], v["ringpipe"]["total"]
        lines.append(
            f"| {kind} | {s['params']:,} | {ranks} | {comp} | {_ms(b)} | {_ms(d)} ({_ms(v['ddp']['min'])}-"
            f"{_ms(v['ddp']['max'])}) | {_ms(r)} ({_ms(v['ringpipe']['min'])}-{_ms(v['ringpipe']['max'])}) | "
            f"**{s['ratio_median']:.3f}** ({s['ratio_min']:.3f}-{s['ratio_max']:.3f}) | {_ms(d - b)} | {_ms(r - b)} |"
        )
    if any("ddp_over_serial" in s for *_, s in results):
        lines += ["", "Against the bound plus one bare blocking allreduce of all gradients (`serial`; median over "
                  "runs of each run's ratio, lowest-highest):", "",
                  "| model | ranks | wire | serial (ms) | DDP / serial | ringpipe / serial |",
                  "| --- | ---: | --- | ---: | --- | --- |"]
        for kind, ranks, comp, s in results:
            if "ddp_over_serial" in s:
                d, r = s["ddp_over_serial"], s["ringpipe_over_serial"]
                lines.append(f"| {kind} | {ranks} | {comp} | {_ms(s['variants']['serial']['total'])} | "
                             f"{d[0]:.3f} ({d[1]:.3f}-{d[2]:.3f}) | {r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f}) |")
    for name, what in AGAINST_DEFAULTS.items():
        cells = [f"{kind} {ranks} {comp}: {h[0]:.3f} ({h[1]:.3f}-{h[2]:.3f})" for kind, ranks, comp, s in results
                 for h in [s["against_defaults"].get(name)] if h]
        if cells:
            lines += ["", f"{what} (`{name}` / `ringpipe`, median over runs of each run's ratio, lowest-highest): "
                      + "; ".join(cells)]
    names = _names(results)
    lines += ["", "Single steps (ms, median over runs of each run's 10th / 50th / 90th percentile):", "",
              "| model | ranks | wire | " + " | ".join(names) + " |",
              "| --- | ---: | --- |" + " ---: |" * len(names)]
    for kind, ranks, comp, s in results:
        cells = [" / ".join(_ms(s["variants"][n][k]) for k in ("p10", "total", "p90")) if n in s["variants"] else ""
                 for n in names]
        lines.append(f"| {kind} | {ranks} | {comp} | " + " | ".join(cells) + " |")
    lines += ["", "Per phase (ms, median over runs): forward / backward / step; ringpipe's clock: copies in, "
              "ready to task, engine tasks, copies out, wait in step(), optimizer arithmetic on buckets already "
              "reduced while later ones travel (bucket step)", "",
              "| model | ranks | wire | variant | forward | backward | step | copy | ready→task | engine | copy out | wait |"
              " bucket step |",
              "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, ranks, comp, s in results:
        for name, v in s["variants"].items():
            extra = " | ".join(_ms(v[k]) if k in v else "" for k in CLOCK)
            lines.append(f"| {kind} | {ranks} | {comp} | {name} | {_ms(v['forward'])} | {_ms(v['backward'])} | "
                         f"{_ms(v['step'])} | {extra} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small,mlp,resnet,transformer")
    p.add_argument("--ranks", default="2", help="comma-separated world sizes (4 oversubscribes a 2-core host)")
    p.add_argument("--compression", default="none", help="comma-separated: none, fp16")
    p.add_argument("--runs", type=int, default=5, help="independent runs (fresh processes) per configuration")
    p.add_argument("--blocks", type=int, default=6, help="alternating timing blocks per variant and run")
    p.add_argument("--steps", type=int, default=0, help="timed steps per block (default: by model)")
    p.add_argument("--nojoin", action="store_true", help="also time DistributedOptimizer(join_support=False)")
    p.add_argument("--serial", action="store_true",
                   help="also time the bound plus one blocking allreduce of all gradients (the transport alone)")
    p.add_argument("--held", action="store_true",
                   help="also time DistributedOptimizer(overlap=False): buckets held until backward ends")
    p.add_argument("--whole-step", action="store_true",
                   help="also time synchronize() then step() in skip_synchronize(): one update after all reductions")
    p.add_argument("--json", default=None, help="write the numbers to this file")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where models and batches live")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="transport of DDP and ringpipe alike (nccl: one rank per GPU, --device cuda)")
    p.add_argument("--quick", action="store_true",
                   help="seconds: the tiny model, 2 ranks, one run of 2 blocks, every optional variant")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.ranks, args.compression, args.runs, args.blocks, args.steps = "tiny", "2", "none", 1, 2, 2
        args.nojoin = args.serial = args.held = args.whole_step = True
    report.header("dp_vs_ddp", argv)
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl moves CUDA tensors only: add --device cuda")
    default_steps = {"small": 60, "transformer": 15, "mlp": 5, "resnet": 3}
    if args.device == "cuda":  # steps of a millisecond or less: more of them per block
        default_steps = {"small": 200, "transformer": 100, "mlp": 100, "resnet": 50}
    extras = tuple(name for name, asked in (("serial", args.serial), ("ringpipe-held", args.held),
                                            ("ringpipe-whole", args.whole_step)) if asked)
    results = []
    for kind in args.models.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            for comp in args.compression.split(","):
                steps = args.steps or default_steps.get(kind, 5)
                runs = [_one_run(kind, ranks, comp, args.blocks, steps, args.nojoin, args.device, args.backend,
                                 extras)
                        for _ in range(args.runs)]
                s = summarize(runs)
                results.append((kind, ranks, comp, s))
                print(f"{kind} ranks={ranks} wire={comp} on {s['device']} over {s['backend']}: ringpipe/DDP {s['ratio_median']:.3f} "
                      f"({s['ratio_min']:.3f}-{s['ratio_max']:.3f}); load {os.getloadavg()[0]:.1f}", flush=True)
    print(tables(results))
    report.headline([(f"DistributedOptimizer step time, {kind}, {ranks} ranks, wire {comp}", "torch DDP",
                      stats.Spread(s["ratio_median"], s["ratio_min"], s["ratio_max"], "runs"))
                     for kind, ranks, comp, s in results])
    report.footer()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": k, "ranks": r, "wire": c, **s} for k, r, c, s in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
