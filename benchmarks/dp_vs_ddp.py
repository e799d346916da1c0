"""Step time of ringpipe's DistributedOptimizer against torch DDP, same model, batch and transport.

    python benchmarks/dp_vs_ddp.py                      # 2 ranks, gloo (local launcher)
    mpirun -n 2 python benchmarks/dp_vs_ddp.py --mpi    # 2 ranks under mpirun: MPI communicator too

Models: a ~10M-parameter MLP and a small CNN. For each model the ranks time, in alternating
blocks within one run, a training step (forward, backward, gradient averaging, SGD step) of

- ``ringpipe``: ``DistributedOptimizer`` on the gloo communicator (and on the MPI one with --mpi),
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the gloo process group,

and, before the ranks start, ``alone``: the same step in one process without communication.
Reported: median step time per variant and the ratios ringpipe/ddp and x/alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from ringpipe.comm import Communicator, init_world
from ringpipe.dp import DistributedOptimizer

__all__ = ["main", "make_model", "time_steps"]

BATCH = 32


def make_model(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "small":  # the default run's MLP on 8x8 digits: latency-bound, 17k parameters
        model: nn.Module = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                         nn.Linear(64, 10))
        x = torch.randn(BATCH, 64)
    elif kind == "mlp":
        model = nn.Sequential(
            nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
            nn.Linear(2048, 1536), nn.ReLU(), nn.Linear(1536, 10),
        )
        x = torch.randn(BATCH, 1024)
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
        )
        x = torch.randn(BATCH, 3, 32, 32)
    y = torch.randint(0, 10, (BATCH,))
    return model, x, y


def time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int) -> list[float]:
    times = []
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(n):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _variants(comm: Communicator, kind: str, mpi_comm: Communicator | None) -> dict[str, Any]:
    """Build every variant once (model, optimizer, input) so that blocks can alternate."""
    out: dict[str, Any] = {}
    # join_support=False is the fair peer of DDP without its Join context (even data, no
    # per-step announcement); "-join" is ringpipe's default, ready for hvd.join() on uneven data.
    for name, join_support in (("ringpipe-gloo", False), ("ringpipe-gloo-join", True)):
        model, x, y = make_model(kind)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   model.named_parameters(), comm=comm, join_support=join_support)
        out[name] = (model, opt, x, y)
    model, x, y = make_model(kind)
    ddp = nn.parallel.DistributedDataParallel(model)
    out["ddp-gloo"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), x, y)
    if mpi_comm is not None:
        model, x, y = make_model(kind)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   model.named_parameters(), comm=mpi_comm, join_support=False)
        out["ringpipe-mpi"] = (model, opt, x, y)
    return out


def run_ranks(comm: Communicator, kinds: list[str], blocks: int, steps: int,
              mpi_comm: Communicator | None = None) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    result: dict[str, dict[str, float]] = {}
    for kind in kinds:
        variants = _variants(comm, kind, mpi_comm)
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for model, opt, x, y in variants.values():
            time_steps(model, opt, x, y, 3)  # warm-up
        for block in range(blocks):
            order = list(variants.items())
            if block % 2:
                order.reverse()
            for name, (model, opt, x, y) in order:
                comm.barrier()
                samples[name] += time_steps(model, opt, x, y, steps)
        result[kind] = {name: statistics.median(ts) for name, ts in samples.items()}
        result[kind]["params"] = sum(p.numel() for p in variants["ringpipe-gloo"][0].parameters())
    return result


def alone(kinds: list[str], steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    out = {}
    for kind in kinds:
        model, x, y = make_model(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        time_steps(model, opt, x, y, 3)
        out[kind] = statistics.median(time_steps(model, opt, x, y, steps))
    return out


def report(res: dict[str, dict[str, float]], single: dict[str, float], title: str) -> str:
    lines = [f"### {title}", "",
             "| model | params | variant | median step (ms) | / ddp-gloo | / alone |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for kind, row in res.items():
        ddp = row["ddp-gloo"]
        lines.append(f"| {kind} | {int(row['params']):,} | alone (1 process) | {single[kind] * 1e3:.1f} | | 1.00 |")
        for name, t in row.items():
            if name == "params":
                continue
            lines.append(f"| {kind} | | {name} | {t * 1e3:.1f} | {t / ddp:.3f} | {t / single[kind]:.2f} |")
    return "\n".join(lines)


def _spawned(comm: Communicator, kinds: list[str], blocks: int, steps: int) -> dict[str, dict[str, float]]:
    return run_ranks(comm, kinds, blocks, steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small,mlp,cnn")
    p.add_argument("--blocks", type=int, default=6, help="alternating timing blocks per variant")
    p.add_argument("--steps", type=int, default=5, help="timed steps per block")
    p.add_argument("--mpi", action="store_true", help="running under mpirun: also time the MPI communicator")
    p.add_argument("--json", default=None, help="write the numbers to this file (rank 0)")
    args = p.parse_args(argv)
    kinds = args.models.split(",")
    if args.mpi:
        mpi_comm = init_world("mpi")
        single = alone(kinds, args.blocks * args.steps) if mpi_comm.rank == 0 else {}
        mpi_comm.barrier()
        gloo = init_world("gloo")  # rendezvous through MPI; DDP needs a c10d group
        res = run_ranks(gloo, kinds, args.blocks, args.steps, mpi_comm=mpi_comm)
        title = "2 ranks under mpirun (Open MPI): ringpipe on MPI and on gloo, DDP on gloo"
        rank = mpi_comm.rank
    else:
        from ringpipe.launch import spawn

        # Fork the ranks before this process runs autograd (autograd threads do not survive fork).
        res = spawn(_spawned, 2, args=(kinds, args.blocks, args.steps))[0]
        single = alone(kinds, args.blocks * args.steps)
        title = "2 ranks, gloo, local launcher: ringpipe DistributedOptimizer vs DDP"
        rank = 0
    if rank == 0:
        print(report(res, single, title))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"title": title, "ranks": res, "alone": single}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
