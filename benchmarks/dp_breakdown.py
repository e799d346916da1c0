"""Where a data-parallel step's time goes, DistributedOptimizer against DDP: per thread, or by torch.profiler.

    nice -n -20 python benchmarks/dp_breakdown.py --by threads --models mlp --steps 20
    python benchmarks/dp_breakdown.py --by profiler --models mlp                   # CPU, gloo, 1 rank
    python benchmarks/dp_breakdown.py --by profiler --models mlp --device cuda --trace $OUT/mlp
    python benchmarks/dp_breakdown.py --quick                                      # seconds: both, tiny model

``--by threads`` (was ``dp_threads.py``): runs the variants of ``dp_vs_ddp.py`` (bound, DDP,
ringpipe) on 2 gloo ranks and reads, at each phase boundary of every timed step (forward,
backward, step), every thread's CPU time and the time it waited on a run queue for a core
(``/proc/self/task/*/schedstat``). Threads are grouped as ``main`` (the training thread),
``engine`` (ringpipe's background engine) and the rest by their kernel name (gloo's and torch's
own threads). Printed per rank, variant and phase, milliseconds per step (median over the steps):
wall time, the CPU time of each group and the run-queue wait of each group.

``--by profiler`` (was ``dp_profile.py``): one rank (so the reduction itself costs next to nothing
and what is left is each system's own work per step), the model, batch and optimizer of
``dp_vs_ddp.py``. After a warm-up, ``--steps`` steps of each system run under ``torch.profiler``
(CPU, and CUDA on a GPU); printed: the step time of each (median, synchronised), and per system
the operators with the most self time on the CPU, the number of CUDA kernel launches and of
device synchronisations per step. ``--trace PREFIX`` writes each system's Chrome trace
(``PREFIX.ringpipe.json``, ``PREFIX.ddp.json``) for a closer look.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dp_vs_ddp import variants  # noqa: E402 - the one definition of the variants
from lib import report, stats, timing  # noqa: E402
from lib.models import loss, make_model, sync  # noqa: E402

PHASES = ("forward", "backward", "step")


def _threads() -> dict[int, str]:
    names = {os.getpid(): "main"}
    for t in threading.enumerate():
        if t.name.startswith("ringpipe-engine") and t.native_id is not None:
            names[t.native_id] = "engine"
    return names


def _sample(known: dict[int, str]) -> dict[str, tuple[int, int]]:
    """CPU ns and run-queue wait ns per thread group."""
    out: dict[str, list[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = (int(v) for v in f.read().split())
            name = known.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except OSError:
            continue
        acc = out.setdefault(name, [0, 0])
        acc[0] += run
        acc[1] += wait
    return {k: (v[0], v[1]) for k, v in out.items()}


def _diff(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> dict[str, tuple[float, float]]:
    return {k: ((b[k][0] - a.get(k, (0, 0))[0]) * 1e-6, (b[k][1] - a.get(k, (0, 0))[1]) * 1e-6) for k in b}


def _thread_steps(variant: dict[str, Any], n: int) -> list[dict[str, Any]]:
    model, opt, x, y = variant["model"], variant["opt"], variant["x"], variant["y"]
    rows = []
    for _ in range(n):
        known = _threads()
        s0, t0 = _sample(known), time.perf_counter()
        opt.zero_grad()
        out = loss(model(x), y)
        s1, t1 = _sample(known), time.perf_counter()
        out.backward()
        s2, t2 = _sample(known), time.perf_counter()
        opt.step()
        s3, t3 = _sample(known), time.perf_counter()
        rows.append({"forward": (t1 - t0, _diff(s0, s1)), "backward": (t2 - t1, _diff(s1, s2)),
                     "step": (t3 - t2, _diff(s2, s3))})
    return rows


def threads_ranks(comm: Any, kind: str, steps: int, names: list[str], blocks: int = 4) -> dict[str, Any]:
    """Per variant and phase on this rank: median wall ms, and CPU and run-queue ms per thread group."""
    torch.set_num_threads(1)
    built = {k: v for k, v in variants(comm, kind, "none", False, torch.device("cpu")).items() if k in names}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in built}
    for v in built.values():
        _thread_steps(v, 3)
    for block in range(blocks):
        for name in timing.order(list(built), block):
            comm.barrier()
            rows[name] += _thread_steps(built[name], max(1, steps // blocks))
    out: dict[str, Any] = {}
    for name, rs in rows.items():
        per: dict[str, Any] = {}
        for ph in PHASES:
            groups = sorted({g for r in rs for g in r[ph][1]})
            per[ph] = {
                "wall": stats.median([r[ph][0] * 1e3 for r in rs]),
                "cpu": {g: stats.median([r[ph][1].get(g, (0.0, 0.0))[0] for r in rs]) for g in groups},
                "wait": {g: stats.median([r[ph][1].get(g, (0.0, 0.0))[1] for r in rs]) for g in groups},
            }
        out[name] = per
    return out


def _profiled_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """One training step, waited for on the device."""
    opt.zero_grad()
    loss(model(x), y).backward()
    opt.step()
    sync(x.device)


def profiler_rank(comm: Any, kind: str, device_type: str, steps: int, trace: str | None) -> dict[str, Any]:
    """Each system's median step time, then ``steps`` steps under torch.profiler (one rank)."""
    from torch.profiler import ProfilerActivity, profile

    from ringpipe.dp import DistributedOptimizer

    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    out: dict[str, Any] = {}
    for name in ("ringpipe", "ddp"):
        model, x, y = make_model(kind)
        model, x, y = model.to(device), x.to(device), y.to(device)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name == "ddp":
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
            opt: Any = sgd
        else:
            opt = DistributedOptimizer(sgd, model.named_parameters(), comm=comm)
        for _ in range(10):
            _profiled_step(model, opt, x, y)
        times = timing.timed(lambda: _profiled_step(model, opt, x, y), steps)  # noqa: B023 - called here
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                _profiled_step(model, opt, x, y)
        events = prof.key_averages()
        table = events.table(sort_by="self_cpu_time_total", row_limit=20)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaStreamWaitEvent")
        if trace:
            prof.export_chrome_trace(f"{trace}.{name}.json")
        out[name] = {"median_ms": stats.median(times) * 1e3, "table": table,
                     "launches_per_step": launches / steps, "syncs_per_step": syncs / steps}
    return out


def _by_threads(models: list[str], steps: int, names: list[str]) -> None:
    from ringpipe.launch import spawn

    rows = []
    for kind in models:
        for rank, r in enumerate(spawn(threads_ranks, 2, args=(kind, steps, names))):
            for name, per in r.items():
                for ph in PHASES:
                    d = per[ph]
                    cpu = " ".join(f"{g}={v:.1f}" for g, v in d["cpu"].items() if v >= 0.05)
                    wait = " ".join(f"{g}={v:.1f}" for g, v in d["wait"].items() if v >= 0.05)
                    rows.append((kind, rank, name, ph, f"{d['wall']:.2f}", cpu, wait))
    print("\nPer thread group, ms per step (median over the steps):\n")
    print(report.table(("model", "rank", "variant", "phase", "wall", "CPU", "run-queue wait"), rows,
                       (False, True, False, False, True, False, False)))


def _by_profiler(models: list[str], device: str, steps: int, trace: str | None) -> None:
    from ringpipe.launch import spawn

    backend = "nccl" if device == "cuda" else "gloo"
    rows, tables = [], []
    for kind in models:
        (res,) = spawn(profiler_rank, 1, backend=backend, args=(kind, device, steps, trace))
        for name, r in res.items():
            rows.append((kind, name, f"{r['median_ms']:.2f}", f"{r['launches_per_step']:.1f}",
                         f"{r['syncs_per_step']:.1f}"))
            tables.append(f"=== {name}: {kind} on {device} over {backend}, 1 rank\n{r['table']}")
    print(f"\nOne rank, median step of {steps} and torch.profiler over as many:\n")
    print(report.table(("model", "system", "step (ms)", "kernel launches / step", "syncs / step"), rows,
                       (False, False, True, True, True)))
    print("\n" + "\n".join(tables))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--by", choices=("threads", "profiler"), default="threads")
    p.add_argument("--models", default="mlp", help="comma-separated: small, mlp, resnet, transformer")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--variants", default="bound,ddp,ringpipe", help="--by threads: dp_vs_ddp's variants")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="--by profiler: where the model lives")
    p.add_argument("--trace", default=None, metavar="PREFIX", help="--by profiler: write each system's Chrome trace")
    p.add_argument("--quick", action="store_true", help="seconds: both breakdowns on the tiny model, 4 steps")
    args = p.parse_args(argv)
    report.header("dp_breakdown", argv)
    models = args.models.split(",")
    if args.quick:
        _by_threads(["tiny"], 4, args.variants.split(","))
        _by_profiler(["tiny"], "cpu", 4, None)
    elif args.by == "threads":
        _by_threads(models, args.steps, args.variants.split(","))
    else:
        _by_profiler(models, args.device, args.steps, args.trace)
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
