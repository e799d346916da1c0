"""`ringpipe bench`: time ringpipe's collectives and the backend's native ones side by side.

Runs inside every rank of a job started by any launcher (``ringpipe launch``, ``torchrun``,
``mpirun``, ``srun``), or starts ``-n`` local processes itself (under ``mpirun`` for the mpi
backend), as ``ringpipe doctor -n`` does. Sizes sweep from ``-b`` to ``-e`` by factor ``-f`` as
in nccl-tests. The variants of one size are timed in interleaved blocks over ``-r`` rounds
(:mod:`ringpipe.observe.bench_measure`); rank 0 prints a size's rows as soon as it is measured:
the time per call (min / median / max over the rounds, the slowest rank in each),
``algbw = S / t`` and ``busbw = algbw * factor`` of the median (nccl-tests factors: ``2(p-1)/p``
for allreduce, ``(p-1)/p`` for allgather and reduce-scatter, 1 for broadcast and p2p, where ``S``
is the whole buffer: the gathered output for allgather, the input for reduce-scatter) and the
number of wrong elements in a checked call. With a native row beside others, a line per size
gives the best own algorithm / native and auto / native and whether their spreads overlap
(:mod:`ringpipe.observe.bench_report`), and a summary table closes the sweep.

``auto`` rows name the algorithm ``auto`` ran at that size (``auto>native``, ``auto>ring``...).
Before an allreduce sweep that includes ``auto``, every rank runs the probe of
:mod:`ringpipe.collectives.autotune` once over the sweep's sizes, in the probe's own rounds per size
(``--no-probe``: the recorded rules instead; ``--auto-table FILE``: read the table from FILE when
it exists, else write it there), and prints its choices with their paired ratios to native.

Buffers live where the communicator takes tensors (the pinned GPU under NCCL, the CPU under
gloo and MPI), and CUDA work is synchronised before the clock is read.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import torch

from ringpipe.comm.base import Communicator
from ringpipe.observe.bench_measure import (
    COLLECTIVES,
    _runner,  # noqa: F401 - re-exported for callers of the single-module layout
    _sizes,
    bus_factor,
    check_algorithms,
    parse_size,
    run_bench,
)
from ringpipe.observe.bench_report import (
    _HEAD,
    compare,
    format_comparison,
    format_row,
    format_summary,
    format_table,  # noqa: F401 - re-exported
    plot,
    plot_figure,  # noqa: F401 - re-exported
)

__all__ = ["COLLECTIVES", "add_parser", "bench_main", "bus_factor", "check_algorithms", "parse_size", "run_bench"]

log = logging.getLogger(__name__)


def _options(args: Any) -> tuple[list[int], list[str] | None, torch.dtype]:
    """Sizes, algorithms and dtype from the command line; ValueError with the reason when wrong."""
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {args.dtype!r} (e.g. float32, int32)")
    if args.iters is not None and args.iters < 1:
        raise ValueError(f"--iters (timed iterations per block) must be >= 1, got {args.iters}")
    if args.repeats < 1:
        raise ValueError(f"-r (interleaved rounds per size) must be >= 1, got {args.repeats}")
    if args.warmup < 0:
        raise ValueError(f"-w (warm-up iterations per size) must be >= 0, got {args.warmup}")
    if args.nprocs is not None and args.nprocs < 1:
        raise ValueError(f"-n (processes to start) must be >= 1, got {args.nprocs}")
    item = torch.empty((), dtype=dtype).element_size()
    begin, end = parse_size(args.begin), parse_size(args.end)
    if end < item:
        raise ValueError(f"-e {end} is smaller than one {args.dtype} element ({item} bytes): nothing to measure; "
                         f"give -e {item} or more")
    sizes = _sizes(begin, end, args.factor, item)
    algos = [a for a in args.algorithms.split(",") if a] if args.algorithms else None
    check_algorithms(args.collective, algos)
    return sizes, algos, dtype


def bench_job(comm: Communicator, args: Any, sizes: list[int], algos: list[str] | None,
              dtype: torch.dtype) -> int:
    """The sweep every rank runs; rank 0 prints each row as measured and writes the plot. Returns the exit status."""
    root = comm.rank == 0
    if comm.size == 1:
        print(f"ringpipe bench: running on 1 rank; for N ranks add -n N (`ringpipe bench {args.collective} -n 4`), "
              f"or run under a launcher: `ringpipe launch -n N -m ringpipe.cli bench {args.collective} ...` or "
              f"`mpirun -n N ringpipe bench {args.collective} --backend mpi ...`", file=sys.stderr, flush=True)
        if args.collective == "p2p":
            print("ringpipe bench: p2p needs at least 2 ranks", file=sys.stderr)
            return 2
    if root and not args.json:
        print(f"# ringpipe bench {args.collective}: {comm.size} ranks, backend {comm.backend}, "
              f"{args.repeats} interleaved rounds of {args.iters or 'about 0.2 s of'} calls, {args.warmup} warm-up; "
              "times per call (min/median/max over rounds), bandwidths in GB/s", flush=True)
        print(_HEAD, flush=True)

    comparisons: list[dict[str, Any]] = []
    table = None
    if args.collective == "allreduce" and "auto" in check_algorithms("allreduce", algos) and not args.no_probe:
        table = _probe(comm, args, sizes, dtype, root)
    probed = {b: (c, t) for b, c, t in table.rows} if table is not None else {}

    def show(size_rows: list[dict[str, Any]]) -> None:
        c = compare(size_rows, probed.get(max(size_rows[0]["bytes"], 4)) if size_rows else None)
        if c is not None:
            comparisons.append(c)
        if not root:
            return
        for row in size_rows:
            print(json.dumps(row) if args.json else format_row(row), flush=True)
        if c is not None:
            print(json.dumps(c) if args.json else format_comparison(c), flush=True)

    rows = run_bench(comm, args.collective, sizes, algos, args.iters, args.warmup, dtype,
                     check=not args.no_check, repeats=args.repeats, on_size=show)
    if root and comparisons and not args.json:
        print("# against native, one statistic throughout: 'x native' is the median over the rounds of the variant's "
              "time over native's in the same round (below 1: faster), 'faster' the rounds it was faster in; a "
              "verdict needs 2/3 of the rounds and 10 % either way, as auto's probe asks; the probe's columns are the same statistic "
              "over the probe's own rounds, timed before the sweep, so they differ from the sweep's by the noise "
              "between the two", flush=True)
        print("\n".join("# " + line for line in format_summary(comparisons).splitlines()), flush=True)
    if root and args.plot:
        plot(rows, args.plot)
        print(f"ringpipe bench: busbw plot written to {os.path.abspath(args.plot)}", file=sys.stderr, flush=True)
    return 1 if any(r["wrong"] for r in rows) else 0


def _probe(comm: Communicator, args: Any, sizes: list[int], dtype: torch.dtype, root: bool) -> Any:
    """Give ``auto`` its measured table: read from ``--auto-table`` when the file exists, else probe (and write it).
    Returns the table (:class:`ringpipe.collectives.autotune.Table`)."""
    from ringpipe.collectives import autotune

    path = args.auto_table
    if path and os.path.exists(path):
        table = autotune.load(comm, path)
        how = f"read from {path}"
    else:
        t0 = time.perf_counter()
        table = autotune.probe(comm, sorted({max(s, 4) for s in sizes}), dtype=dtype)
        how = f"probed in {time.perf_counter() - t0:.1f} s"
        if path and root:
            table.save(path)
            how += f", written to {path}"
    if root:
        print(f"ringpipe bench: auto table {how}: {table}", file=sys.stderr, flush=True)
    return table


def _bench_mpirun(args: Any, argv: list[str]) -> int:
    """Start ``-n`` ranks of this same command under mpirun (the mpi backend needs it)."""
    from ringpipe.launch import mpirun_command

    # Only rank 0 prints, so mpirun's tags (which may land in the middle of a long line) are left off.
    cmd = mpirun_command(args.nprocs, [sys.executable, "-m", "ringpipe.cli", "bench", *argv], tag_output=False)
    env = dict(os.environ, RINGPIPE_BACKEND="mpi", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env).returncode


def _argv_of(args: Any) -> list[str]:
    """This bench's own options, for each rank that mpirun starts."""
    argv = [args.collective, "-b", str(args.begin), "-e", str(args.end), "-f", str(args.factor),
            "-r", str(args.repeats), "-w", str(args.warmup), "-d", args.dtype, "--backend", "mpi"]
    if args.iters is not None:
        argv += ["--iters", str(args.iters)]
    if args.algorithms:
        argv += ["-a", args.algorithms]
    if args.plot:
        argv += ["--plot", str(args.plot)]
    if args.auto_table:
        argv += ["--auto-table", str(args.auto_table)]
    flags = (("--no-check", args.no_check), ("--json", args.json), ("--no-probe", args.no_probe))
    return argv + [f for f, on in flags if on]


def bench_main(args: Any) -> int:
    from ringpipe.comm import init_world, shutdown_world
    from ringpipe.comm.base import CommError
    from ringpipe.comm.rendezvous import BACKENDS
    from ringpipe.env import EnvironmentError_

    # Usage errors stop every rank alike before any of them communicates.
    try:
        sizes, algos, dtype = _options(args)
    except ValueError as exc:
        print(f"ringpipe bench: {exc}", file=sys.stderr)
        return 2
    if parse_size(args.begin) < torch.empty((), dtype=dtype).element_size() and int(os.environ.get("RANK", "0")) == 0:
        print(f"ringpipe bench: -b {args.begin} starts the sweep at one {args.dtype} element "
              f"({sizes[0] or torch.empty((), dtype=dtype).element_size()} bytes)", file=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    backend = (args.backend or os.environ.get("RINGPIPE_BACKEND") or "gloo").lower()
    if backend not in BACKENDS:
        print(f"ringpipe bench: unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    launched = "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ
    if args.nprocs and args.nprocs > 1 and not launched:
        if backend == "mpi":
            try:
                return _bench_mpirun(args, _argv_of(args))
            except FileNotFoundError as exc:
                print(f"ringpipe bench: --backend mpi with -n {args.nprocs} starts the ranks under mpirun: {exc}; "
                      "or use --backend gloo", file=sys.stderr)
                return 2
        from ringpipe.launch import WorkerFailed, spawn

        try:
            return int(max(spawn(bench_job, args.nprocs, backend, args=(args, sizes, algos, dtype))))
        except WorkerFailed as exc:
            print(f"ringpipe bench: {exc}; the other ranks were stopped", file=sys.stderr)
            return 1
    try:
        comm = init_world(backend)
    except (CommError, EnvironmentError_) as exc:
        print(f"ringpipe bench: {exc}", file=sys.stderr)
        return 2
    try:
        return bench_job(comm, args, sizes, algos, dtype)
    finally:
        shutdown_world()


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="time collectives (ringpipe's algorithms and the native ones) over a size sweep",
        description=(
            "Start N local processes with -n N (`ringpipe bench allreduce -n 4`; under mpirun with --backend "
            "mpi), or run under a launcher: `ringpipe launch -n 4 -m ringpipe.cli bench allreduce`, "
            "`mpirun -n 4 ringpipe bench allreduce --backend mpi`. Prints one row per size and algorithm "
            "as it is measured: time (min/median/max over interleaved rounds), algbw, busbw (nccl-tests factors), "
            "wrong results; then auto's choice and the ratios to native per size, with a verdict where the "
            "spreads do not overlap."
        ),
    )
    p.add_argument("collective", choices=COLLECTIVES)
    p.add_argument("-b", "--begin", default="4K", help="smallest size, bytes (4K, 1M, ...)")
    p.add_argument("-e", "--end", default="64M", help="largest size, bytes")
    p.add_argument("-f", "--factor", type=float, default=2.0, help="size multiplication factor")
    p.add_argument("-n", "--nprocs", type=int, default=None,
                   help="start N local processes (when not under a launcher), as everywhere in ringpipe")
    p.add_argument("-i", "--iters", type=int, default=None,
                   help="calls per timed block (nccl-tests' -n; in ringpipe -n is the number of processes); "
                        "default: about 0.2 s of calls, 3 to 100")
    p.add_argument("-r", "--repeats", type=int, default=5,
                   help="interleaved rounds per size: every algorithm is timed once per round, in turns; "
                        "rows give the median and the min/max over the rounds")
    p.add_argument("-w", "--warmup", type=int, default=5, help="warm-up calls per size and algorithm")
    p.add_argument("-d", "--dtype", default="float32", help="element type (float32, float16, int32, ...)")
    p.add_argument("-a", "--algorithms", default=None,
                   help="comma-separated algorithms (default: all of the collective, native and auto)")
    p.add_argument("--backend", default=None, help="gloo, nccl or mpi (default: $RINGPIPE_BACKEND or gloo)")
    p.add_argument("--no-check", action="store_true", help="skip the consistency header")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--no-probe", action="store_true",
                   help="auto follows its recorded rules instead of probing this job's sizes first")
    p.add_argument("--auto-table", default=None, metavar="FILE.json",
                   help="auto's measured table: read from FILE when it exists, else probe and write it there")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw busbw against size per algorithm")
    p.set_defaults(func=bench_main)
