"""What ``algorithm="auto"`` adds to an allreduce where it runs the backend's own: its choice, timed alone.

    python benchmarks/auto_dispatch_cost.py                  # gloo, 2 ranks, probe first, 4 KiB - 64 MiB
    python benchmarks/auto_dispatch_cost.py --no-probe       # auto's rules without a probe table
    mpirun --allow-run-as-root --oversubscribe -n 2 python benchmarks/auto_dispatch_cost.py --backend mpi

Where ``auto`` picks the backend's collective, ``ringpipe.collectives.allreduce(..., "auto")``
and ``(..., "native")`` take the same path except for one call that makes the choice
(``_auto_runs_native``: the dtype test and ``auto.choose``, the probe table's cached answer). A
timed comparison of the two whole calls cannot separate them on a shared 2-core host (native
against itself moves by 0.82-1.06 between rounds), so this times the choice by itself, many
thousand times (thread CPU time), next to the median of the native allreduce of the same size in the same job:
``native / (native + choice)`` is then the least ``auto / native`` can be at that size. Sizes where
``auto`` picks one of ringpipe's own algorithms are marked; those are compared by ``ringpipe bench``
(paired rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SIZES = tuple(4096 * 4**k for k in range(8))  # 4 KiB .. 64 MiB


def run_ranks(comm, sizes: tuple[int, ...], probe: bool, calls: int, choices: int) -> list[dict]:  # noqa: ANN001
    import torch

    from ringpipe.collectives import _auto_runs_native, auto, autotune

    if probe:
        autotune.probe(comm)
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        choice = auto.choose("allreduce", nbytes, comm)
        _auto_runs_native(comm, t)  # warm the cache
        t0 = time.thread_time_ns()  # CPU time: the choice is all CPU, and the host is shared
        for _ in range(choices):
            _auto_runs_native(comm, t)
        choose_ns = (time.thread_time_ns() - t0) / choices
        native = []
        for _ in range(calls):
            comm.barrier()
            t0 = time.perf_counter_ns()
            comm.allreduce(t)
            native.append(time.perf_counter_ns() - t0)
        slowest = comm.allgather_object((choose_ns, native))
        rows.append({"bytes": nbytes, "choice": choice, "choose_ns": max(c for c, _ in slowest),
                     "native_ns": statistics.median(max(n[i] for _, n in slowest) for i in range(calls))})
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| size | auto picks | choice, CPU ns per call (slowest rank) | native allreduce, us (median) | "
             "native / (native + choice) |", "| ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        size = f"{r['bytes'] >> 20} MiB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KiB"
        bound = r["native_ns"] / (r["native_ns"] + r["choose_ns"])
        note = f"{bound:.4f}" if r["choice"] == "native" else f"({bound:.4f}; auto runs {r['choice']})"
        lines.append(f"| {size} | {r['choice']} | {r['choose_ns']:.0f} | {r['native_ns'] / 1e3:.0f} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="gloo", choices=("gloo", "mpi"))
    p.add_argument("--no-probe", dest="probe", action="store_false", help="auto's rules without a probe table")
    p.add_argument("--calls", type=int, default=15, help="native allreduces timed per size")
    p.add_argument("--choices", type=int, default=20000, help="choices timed per size")
    args = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if args.backend == "mpi":
        from ringpipe.comm import init_world

        comm = init_world(backend="mpi")
        rows = run_ranks(comm, SIZES, args.probe, args.calls, args.choices)
        if comm.rank != 0:
            return 0
    else:
        from ringpipe.launch import spawn

        rows = spawn(run_ranks, args.ranks, args=(SIZES, args.probe, args.calls, args.choices))[0]
    print(f"{args.backend}, {args.ranks if args.backend == 'gloo' else 'mpirun'} ranks, float32, "
          f"probe table: {'yes' if args.probe else 'no (rules)'}; load average after: {os.getloadavg()[0]:.2f}")
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
