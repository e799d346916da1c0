"""ringpipe's collective algorithms against native gloo all_reduce and MPI_Allreduce, in one run.

    python benchmarks/collectives.py                    # 2 and 4 ranks, gloo and MPI, 4 KiB - 64 MiB
    python benchmarks/collectives.py --max-size 16M --ranks 2

For every backend and world size it starts the ranks (torchrun for gloo, mpirun for MPI),
times every allreduce algorithm and the native collective with ``ringpipe.observe.bench``,
and prints busbw per algorithm, the ratio of ringpipe's best algorithm to native, ``auto``
against native with the algorithm ``auto`` chose at each size (after the one-time probe of
``ringpipe.collectives.autotune``, run first in the same job over the same sizes), and the
cost of the consistency header (the same algorithm with ``check=False``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
ALGOS = ["ring", "rabenseifner", "recursive_doubling", "hierarchical", "auto", "native"]


def worker(args: argparse.Namespace) -> None:
    import torch

    from ringpipe.collectives import autotune
    from ringpipe.comm import init_world, shutdown_world
    from ringpipe.observe.bench import parse_size, run_bench

    torch.set_num_threads(1)
    comm = init_world(args.backend)
    size, rows = parse_size("4K"), []
    sizes = []
    while size <= parse_size(args.max_size):
        sizes.append(size)
        size *= 4
    if not args.no_probe:
        autotune.probe(comm, sizes)
    size = sizes[0]
    while size <= parse_size(args.max_size):
        iters = max(3, min(30, int(4e7 // size)))
        best: dict[str, dict] = {}
        for _ in range(args.repeats):  # the best of a few repeats: the host is shared
            got = run_bench(comm, "allreduce", [size], ALGOS, iters=iters, warmup=2)
            for row in run_bench(comm, "allreduce", [size], ["ring", "recursive_doubling"],
                                 iters=iters, warmup=2, check=False):
                row["algorithm"] += "/nocheck"
                got.append(row)
            for row in got:
                old = best.get(row["algorithm"])
                if old is None or row["time_us"] < old["time_us"]:
                    best[row["algorithm"]] = row
        rows += best.values()
        size *= 4
    if comm.rank == 0:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    shutdown_world()


def launch(backend: str, nprocs: int, max_size: str, repeats: int, no_probe: bool = False) -> list[dict]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ringpipe-bench-", dir=".") as tmp:
        return _launch(backend, nprocs, max_size, repeats, Path(tmp) / "rows.jsonl", no_probe)


def _launch(backend: str, nprocs: int, max_size: str, repeats: int, out_file: Path,
            no_probe: bool = False) -> list[dict]:
    from ringpipe.comm.world import free_port
    from ringpipe.launch import mpirun_command

    argv = [str(HERE), "--worker", "--backend", backend, "--max-size", max_size,
            "--repeats", str(repeats), "--out", str(out_file.resolve())] + (["--no-probe"] if no_probe else [])
    if backend == "mpi":
        cmd = mpirun_command(nprocs, [sys.executable, *argv])
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
               f"--master-port={free_port('127.0.0.1')}", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{backend} x{nprocs} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in out_file.read_text().splitlines() if line]


def report(rows: list[dict], backend: str, nprocs: int) -> None:
    sizes = sorted({r["bytes"] for r in rows})
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    get = {(r["bytes"], r["algorithm"]): r for r in rows}
    print(f"\n## allreduce, {nprocs} ranks, {backend} (busbw GB/s; latency of the smallest size below the table)")
    print(f"{'size':>9} " + " ".join(f"{n[:14]:>14}" for n in names) + f" {'best/native':>11} {'hdr cost':>9}"
          f" {'auto/native':>11} {'auto chose':>18}")
    for s in sizes:
        cells = [get[(s, n)]["busbw_gbps"] for n in names]
        ours = [get[(s, n)]["busbw_gbps"] for n in ALGOS if n not in ("native", "auto")]
        native = get[(s, "native")]["busbw_gbps"]
        ratio = max(ours) / native
        auto = get[(s, "auto")]
        hdr = get[(s, "ring")]["time_us"] / get[(s, "ring/nocheck")]["time_us"]
        label = f"{s // 1024}K" if s < 1 << 20 else f"{s >> 20}M"
        print(f"{label:>9} " + " ".join(f"{c:>14.3f}" for c in cells) + f" {ratio:>11.2f} {hdr:>9.2f}"
              f" {auto['busbw_gbps'] / native:>11.2f} {auto.get('chosen', '?'):>18}")
    small = sizes[0]
    best = min(get[(small, n)]["time_us"] for n in ALGOS if n != "native")
    print(f"latency at {small} B: best ringpipe {best:.0f} us, native {get[(small, 'native')]['time_us']:.0f} us "
          f"(ratio {best / get[(small, 'native')]['time_us']:.2f}); wrong results: "
          f"{sum(r['wrong'] for r in rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--max-size", default="64M")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--repeats", type=int, default=3, help="keep the fastest of this many runs")
    ap.add_argument("--backends", default="gloo,mpi")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write every row to this file")
    ap.add_argument("--no-probe", action="store_true", help="auto follows its recorded rules (no probe first)")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    everything = []
    for backend in args.backends.split(","):
        for n in (int(x) for x in args.ranks.split(",")):
            rows = launch(backend, n, args.max_size, args.repeats, args.no_probe)
            report(rows, backend, n)
            everything += rows
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in everything) + "\n")


if __name__ == "__main__":
    main()
