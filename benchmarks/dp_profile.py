"""Where a DistributedOptimizer step spends its time, by torch.profiler, against DDP's on the same model.

    python benchmarks/dp_profile.py --model mlp                           # CPU, gloo, 1 rank
    python benchmarks/dp_profile.py --model mlp --device cuda --trace $OUT/mlp   # GPU, NCCL

One rank (so the reduction itself costs next to nothing and what is left is each system's own
work per step), the model, batch and optimizer of ``benchmarks/dp_vs_ddp.py``. After a warm-up,
``--steps`` steps of each system run under ``torch.profiler`` (CPU, and CUDA on a GPU); printed:
the step time of each (median, synchronised), and per system the operators with the most self
time on the CPU, the number of CUDA kernel launches and of device synchronisations per step.
``--trace PREFIX`` writes each system's Chrome trace (``PREFIX.ringpipe.json``,
``PREFIX.ddp.json``) for a closer look.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_vs_ddp import _loss, _sync, make_model  # noqa: E402 - the one definition of the models and step


def _step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """One training step, waited for on the device."""
    opt.zero_grad()
    _loss(model(x), y).backward()
    opt.step()
    _sync(x.device)


def _profile(comm: Any, kind: str, device_type: str, steps: int, trace: str | None) -> dict[str, Any]:
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
            _step(model, opt, x, y)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _step(model, opt, x, y)
            times.append(time.perf_counter() - t0)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                _step(model, opt, x, y)
        events = prof.key_averages()
        table = events.table(sort_by="self_cpu_time_total", row_limit=20)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaStreamWaitEvent")
        if trace:
            prof.export_chrome_trace(f"{trace}.{name}.json")
        out[name] = {"median_ms": statistics.median(times) * 1e3, "table": table,
                     "launches_per_step": launches / steps, "syncs_per_step": syncs / steps}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp", help="small, mlp, resnet or transformer (dp_vs_ddp's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=20, help="profiled (and, before, timed) steps per system")
    p.add_argument("--trace", default=None, metavar="PREFIX", help="write each system's Chrome trace")
    args = p.parse_args(argv)
    from ringpipe.launch import spawn

    backend = "nccl" if args.device == "cuda" else "gloo"
    (res,) = spawn(_profile, 1, backend=backend, args=(args.model, args.device, args.steps, args.trace))
    for name, r in res.items():
        print(f"=== {name}: {args.model} on {args.device} over {backend}, 1 rank: step {r['median_ms']:.2f} ms "
              f"(median of {args.steps}); per step {r['launches_per_step']:.1f} kernel launches, "
              f"{r['syncs_per_step']:.1f} synchronisations / stream waits")
        print(r["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
