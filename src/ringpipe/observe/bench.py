"""`ringpipe bench`: time ringpipe's collectives and the backend's native ones side by side.

Runs inside every rank of a job started by any launcher (``ringpipe launch``, ``torchrun``,
``mpirun``, ``srun``), or starts ``-n`` local processes itself (under ``mpirun`` for the mpi
backend), as ``ringpipe doctor -n`` does. Rank 0 prints each row as soon as it is measured.
Sizes sweep from ``-b`` to ``-e`` by factor ``-f`` as in nccl-tests;
for every size and algorithm it reports the time per call (min / avg / max over ranks),
``algbw = S / t`` and ``busbw = algbw * factor`` (nccl-tests factors: ``2(p-1)/p`` for
allreduce, ``(p-1)/p`` for allgather and reduce-scatter, 1 for broadcast and p2p, where ``S``
is the whole buffer: the gathered output for allgather, the input for reduce-scatter) and the
number of wrong elements in a checked call.

``auto`` rows name the algorithm ``auto`` ran at that size (``auto>native``, ``auto>ring``...).
Before an allreduce sweep that includes ``auto``, every rank runs the probe of
:mod:`ringpipe.collectives.autotune` once over the sweep's sizes (``--no-probe``: the recorded
rules instead; ``--auto-table FILE``: read the table from FILE when it exists, else write it there).

Buffers live where the communicator takes tensors (the pinned GPU under NCCL, the CPU under
gloo and MPI), and CUDA work is synchronised before the clock is read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ringpipe import collectives
from ringpipe.collectives.common import home_device
from ringpipe.comm.base import Communicator

__all__ = ["add_parser", "bench_main", "run_bench", "parse_size", "bus_factor", "check_algorithms", "COLLECTIVES"]

log = logging.getLogger(__name__)

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "p2p")
_API = {"allreduce": "allreduce", "allgather": "allgather", "reducescatter": "reduce_scatter",
        "broadcast": "broadcast"}


def bus_factor(collective: str, p: int) -> float:
    """nccl-tests' busbw / algbw factor for ``collective`` on ``p`` ranks."""
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("allgather", "reducescatter"):
        return (p - 1) / p
    return 1.0


def parse_size(text: str) -> int:
    """``4K``, ``1M``, ``64MiB``, ``1G`` or plain bytes -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)(i?[Bb])?\s*", str(text))
    if not m:
        raise ValueError(f"size {text!r} is not understood; write bytes like 4096, 4K, 1M or 64MiB")
    return int(m.group(1)) * 1024 ** " KMG".index((m.group(2) or " ").upper())


def _sizes(begin: int, end: int, factor: float, item: int = 1) -> list[int]:
    """Sizes from ``begin`` to ``end`` bytes by ``factor``, each at least ``item`` bytes past the last.

    A ``begin`` of 0 comes first (timed as the smallest buffer), then the sweep goes on from one element.
    """
    if begin < 0 or end < 0:
        raise ValueError(f"sizes must be >= 0, got -b {begin} -e {end}")
    if begin > end:
        raise ValueError(f"-b {begin} is larger than -e {end}; give -b <= -e")
    if begin == end:
        return [begin]
    if factor <= 1:
        raise ValueError(f"-f must be > 1 to sweep from -b {begin} to -e {end}, got {factor:g}")
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = item if s == 0 else max(int(s * factor), s + item)
    return out


def _count(collective: str, nbytes: int, item: int, p: int) -> int:
    """Elements of the buffer measured for ``nbytes``: at least one (one per rank where it is split)."""
    if collective in ("allgather", "reducescatter"):
        count = max(p, nbytes // item)
        return count - count % p
    return max(1, nbytes // item)


def _runner(comm: Communicator, collective: str, algo: str, nbytes: int, dtype: torch.dtype,
            check: bool) -> tuple[Callable[[], Any], Callable[[], int], int]:
    """(one call, a checked call returning the number of wrong elements, element count)."""
    p, r = comm.size, comm.rank
    item = torch.empty((), dtype=dtype).element_size()
    device = home_device(comm)
    count = _count(collective, nbytes, item, p)
    if collective == "p2p":
        buf = torch.ones(count, dtype=dtype, device=device)

        def pingpong() -> None:
            if r == 0:
                comm.send(buf, 1)
                comm.recv(buf, 1)
            elif r == 1:
                comm.recv(buf, 0)
                comm.send(buf, 0)

        def p2p_check() -> int:
            buf.fill_(r + 1)
            pingpong()
            return int((buf != 1).sum()) if r == 0 else 0

        return pingpong, p2p_check, count
    name = _API[collective]
    fn = getattr(collectives, name)
    local = count // p if collective == "allgather" else count
    x = torch.ones(local, dtype=dtype, device=device)
    kw: dict[str, Any] = {"algorithm": algo}
    if algo != "native":
        kw["check"] = check

    def call() -> Any:
        return fn(comm, x, **kw)

    def checked() -> int:
        x.fill_(r + 1)
        out = fn(comm, x, **kw)
        total = p * (p + 1) // 2
        if collective == "allreduce":
            return int((x != total).sum())
        if collective == "reducescatter":
            return int((out != total).sum())
        if collective == "broadcast":
            return int((x != 1).sum())
        return sum(int((blk != j + 1).sum()) for j, blk in enumerate(out))

    return call, checked, count


def check_algorithms(collective: str, algorithms: list[str] | None) -> list[str]:
    """The algorithms to time for ``collective`` (all of them when None); ValueError for unknown names."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    if collective == "p2p":
        return ["p2p"]
    valid = collectives.SUPPORTED[_API[collective]]
    algos = algorithms or [a for a in valid if a != "auto"] + ["auto"]
    for a in algos:
        if a not in valid:
            raise ValueError(f"{collective} has no algorithm {a!r}; valid: {', '.join(valid)}")
    return list(algos)


def _sync(comm: Communicator) -> None:
    """Wait for queued GPU work (NCCL returns before the transfer is done)."""
    device = home_device(comm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(
    comm: Communicator,
    collective: str,
    sizes: list[int],
    algorithms: list[str] | None = None,
    iters: int = 20,
    warmup: int = 5,
    dtype: torch.dtype = torch.float32,
    check: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Time ``collective`` for every size and algorithm; every rank returns the same rows.

    Sizes whose buffer rounds to the one of the size before (below one element) are measured once.
    ``on_row`` is called with each row as soon as it is measured (on every rank).
    """
    algos = check_algorithms(collective, algorithms)
    if collective == "p2p" and comm.size < 2:
        raise ValueError("p2p needs at least 2 ranks")
    if iters < 1 or warmup < 0:
        raise ValueError(f"needs iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    rows = []
    item = torch.empty((), dtype=dtype).element_size()
    last: int | None = None
    for nbytes in sizes:
        measured = _count(collective, nbytes, item, comm.size)
        if measured == last:
            continue
        last = measured
        for algo in algos:
            call, checked, count = _runner(comm, collective, algo, nbytes, dtype, check)
            for _ in range(warmup):
                call()
            _sync(comm)
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            _sync(comm)
            dt = (time.perf_counter() - t0) / iters
            if collective == "p2p":
                dt /= 2  # one way of a ping-pong
            wrong = checked()
            gathered = comm.allgather_object((dt, wrong))
            times = [g[0] for g in gathered]
            size_b = count * item
            avg = sum(times) / len(times)
            algbw = size_b / max(times) / 1e9 if max(times) > 0 else 0.0
            chosen = collectives.resolve(_API[collective], "auto", size_b, comm) \
                if algo == "auto" and collective in _API else algo
            rows.append({
                "collective": collective, "algorithm": algo, "chosen": chosen, "backend": comm.backend,
                "ranks": comm.size, "bytes": size_b, "count": count,
                "dtype": str(dtype).removeprefix("torch."),
                "time_us": round(avg * 1e6, 2), "time_min_us": round(min(times) * 1e6, 2),
                "time_max_us": round(max(times) * 1e6, 2), "algbw_gbps": round(algbw, 4),
                "busbw_gbps": round(algbw * bus_factor(collective, comm.size), 4),
                "wrong": sum(g[1] for g in gathered),
            })
            if on_row is not None:
                on_row(rows[-1])
    return rows


_HEAD = (f"{'size(B)':>11} {'count':>10} {'dtype':>8} {'algorithm':>24} {'min(us)':>10} "
         f"{'avg(us)':>10} {'max(us)':>10} {'algbw':>8} {'busbw':>8} {'wrong':>6}")


def format_row(r: dict[str, Any]) -> str:
    algo = r["algorithm"] if r.get("chosen", r["algorithm"]) == r["algorithm"] else f"{r['algorithm']}>{r['chosen']}"
    return (f"{r['bytes']:>11} {r['count']:>10} {r['dtype']:>8} {algo:>24} "
            f"{r['time_min_us']:>10.1f} {r['time_us']:>10.1f} {r['time_max_us']:>10.1f} "
            f"{r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f} {r['wrong']:>6}")


def format_table(rows: list[dict[str, Any]]) -> str:
    return "\n".join([_HEAD, *(format_row(r) for r in rows)])


def _human_size(n: float) -> str:
    for unit in ("", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:g}{unit}"
        n /= 1024
    return f"{n:g}G"


def plot_figure(rows: list[dict[str, Any]]) -> Any:
    """busbw against size, one line per algorithm: both axes logarithmic, sizes labelled 4K, 1M, ... (nccl-tests' way)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        pts = [(r["bytes"], r["busbw_gbps"]) for r in rows if r["algorithm"] == algo]
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=algo)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _human_size(x)))
    if any(r["busbw_gbps"] > 0 for r in rows):
        ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, log scale)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    first = rows[0] if rows else {"collective": "?", "backend": "?", "ranks": "?"}
    ax.set_title(f"{first['collective']} on {first['ranks']} ranks ({first['backend']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Write :func:`plot_figure` to ``path`` (PNG, Agg backend)."""
    import matplotlib.pyplot as plt

    fig = plot_figure(rows)
    fig.savefig(path)
    plt.close(fig)


def _options(args: Any) -> tuple[list[int], list[str] | None, torch.dtype]:
    """Sizes, algorithms and dtype from the command line; ValueError with the reason when wrong."""
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {args.dtype!r} (e.g. float32, int32)")
    if args.iters < 1:
        raise ValueError(f"--iters (timed iterations per size) must be >= 1, got {args.iters}")
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
              f"{args.iters} iters, {args.warmup} warm-up; times per call, bandwidths in GB/s", flush=True)
        print(_HEAD, flush=True)

    def show(row: dict[str, Any]) -> None:
        if root:
            print(json.dumps(row) if args.json else format_row(row), flush=True)

    if args.collective == "allreduce" and "auto" in check_algorithms("allreduce", algos) and not args.no_probe:
        _probe(comm, args, sizes, dtype, root)
    rows = run_bench(comm, args.collective, sizes, algos, args.iters, args.warmup, dtype,
                     check=not args.no_check, on_row=show)
    if root and args.plot:
        plot(rows, args.plot)
        print(f"ringpipe bench: busbw plot written to {os.path.abspath(args.plot)}", file=sys.stderr, flush=True)
    return 1 if any(r["wrong"] for r in rows) else 0


def _probe(comm: Communicator, args: Any, sizes: list[int], dtype: torch.dtype, root: bool) -> None:
    """Give ``auto`` its measured table: read from ``--auto-table`` when the file exists, else probe (and write it)."""
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


def _bench_mpirun(args: Any, argv: list[str]) -> int:
    """Start ``-n`` ranks of this same command under mpirun (the mpi backend needs it)."""
    from ringpipe.launch import mpirun_command

    cmd = mpirun_command(args.nprocs, [sys.executable, "-m", "ringpipe.cli", "bench", *argv])
    env = dict(os.environ, RINGPIPE_BACKEND="mpi", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env).returncode


def _argv_of(args: Any) -> list[str]:
    """This bench's own options, for each rank that mpirun starts."""
    argv = [args.collective, "-b", str(args.begin), "-e", str(args.end), "-f", str(args.factor),
            "--iters", str(args.iters), "-w", str(args.warmup), "-d", args.dtype, "--backend", "mpi"]
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
    from ringpipe.comm.world import BACKENDS
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
            "as it is measured: time (min/avg/max over ranks), algbw, busbw (nccl-tests factors), wrong results."
        ),
    )
    p.add_argument("collective", choices=COLLECTIVES)
    p.add_argument("-b", "--begin", default="4K", help="smallest size, bytes (4K, 1M, ...)")
    p.add_argument("-e", "--end", default="64M", help="largest size, bytes")
    p.add_argument("-f", "--factor", type=float, default=2.0, help="size multiplication factor")
    p.add_argument("-n", "--nprocs", type=int, default=None,
                   help="start N local processes (when not under a launcher), as everywhere in ringpipe")
    p.add_argument("-i", "--iters", type=int, default=20,
                   help="timed iterations per size (nccl-tests' -n; in ringpipe -n is the number of processes)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="warm-up iterations per size")
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
