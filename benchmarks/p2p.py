"""Point-to-point latency and bandwidth: ringpipe's communicator against the raw transport, same run.

Ping-pong between rank 0 and rank 1 for sizes from 8 B to 64 MiB: ringpipe ``comm.send/recv``
(which records every message at the choke point) against ``torch.distributed.send/recv`` (gloo)
or mpi4py ``Send/Recv`` (MPI) on the same connection, and the cost of the recording itself.
Both sides move the same buffer the same number of times; they alternate in ``--repeats``
blocks (the order swapped every block, so drift of a shared machine falls on both), and the
table gives the median over blocks and the median of the per-block time ratios with its range.

    python benchmarks/p2p.py                    # everything: gloo and MPI on one host and across two namespace hosts
    python benchmarks/p2p.py --only local-gloo  # one part
    python benchmarks/p2p.py --only mpi-layers  # where a small MPI message's time goes (was mpi_latency.py)
    python benchmarks/p2p.py --quick            # seconds: the overhead, local gloo at 8 B and 1 KiB, mpi-layers
Worker mode (used by the driver): run under a launcher with ``--worker``.

``--only mpi-layers`` (was ``mpi_latency.py``): 2 ranks under mpirun exchange 4 KiB both ways
(``irecv`` + ``isend`` + both waits) for several rounds: raw mpi4py, ringpipe's communicator
(argument checks, the event record, the handle) with Python's garbage collector on and off, then
a 4 KiB allreduce: ringpipe's checked recursive doubling, the same with ``check=False``, the
communicator's native ``MPI_Allreduce`` and raw mpi4py ``Allreduce``. Every round runs every case
once (the order rotated from round to round); rank 0 prints, per case, the median over rounds of
the mean time per call and the range.

The recording overhead reads ``ringpipe.comm.events.EventLog`` directly (the choke point's own
record, which no public name times alone).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import procs, report, sizes, stats, testhelpers, timing  # noqa: E402

__all__ = ["main"]

SIZES = [8, 1024, 64 * 1024, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 1024]


def _iters(nbytes: int) -> int:
    return max(5, min(500, (256 << 20) // max(nbytes, 1) // 8))


def pingpong(send, recv, rank: int, nbytes: int) -> float:
    """Mean one-way time (s) over a ping-pong loop."""
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
    n = _iters(nbytes)
    for _ in range(3):
        if rank == 0:
            send(buf, 1)
            recv(buf, 1)
        else:
            recv(buf, 0)
            send(buf, 0)
    t0 = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            send(buf, 1)
            recv(buf, 1)
        else:
            recv(buf, 0)
            send(buf, 0)
    return (time.perf_counter() - t0) / (2 * n)


def worker(backend: str, label: str, repeats: int, quick: bool = False) -> None:
    from ringpipe.comm import init_world, shutdown_world

    comm = init_world(backend)
    rank = comm.rank
    if backend == "mpi":
        from mpi4py import MPI

        raw = MPI.COMM_WORLD

        def raw_send(t, p):
            raw.Send(t.numpy(), dest=p)

        def raw_recv(t, p):
            raw.Recv(t.numpy(), source=p)
    else:
        import torch.distributed as dist

        def raw_send(t, p):
            dist.send(t, p)

        def raw_recv(t, p):
            dist.recv(t, p)

    rows = []
    sides = {"native": (raw_send, raw_recv), "ringpipe": (comm.send, comm.recv)}
    for nbytes in QUICK_SIZES if quick else SIZES:
        times: dict[str, list[float]] = {k: [] for k in sides}
        for block in range(repeats):
            for name in timing.order(list(sides), block):
                comm.barrier()
                times[name].append(pingpong(*sides[name], rank, nbytes))
        t_raw, t_rp = statistics.median(times["native"]), statistics.median(times["ringpipe"])
        ratio = stats.ratios(times["ringpipe"], times["native"])
        rows.append({"setup": label, "backend": backend, "bytes": nbytes, "repeats": repeats,
                     "native_us": t_raw * 1e6, "ringpipe_us": t_rp * 1e6,
                     "native_gbps": nbytes / t_raw / 1e9, "ringpipe_gbps": nbytes / t_rp / 1e9,
                     "ratio": ratio.median, "ratio_min": ratio.low, "ratio_max": ratio.high})
    comm.log.clear()
    if rank == 0:
        for r in rows:
            procs.emit(r)
    shutdown_world()


def mpi_layers_worker(rounds: int, calls: int) -> None:
    """Rank side of ``--only mpi-layers``: 4 KiB through each layer, every case once per round."""
    import numpy as np
    from mpi4py import MPI

    from ringpipe import collectives
    from ringpipe.comm import init_world

    torch.set_num_threads(1)
    comm = init_world("mpi")
    world = MPI.COMM_WORLD
    peer = 1 - comm.rank
    a, b = np.ones(1024, dtype=np.float32), np.empty(1024, dtype=np.float32)
    ta, tb, x = torch.ones(1024), torch.empty(1024), torch.ones(1024)

    def raw_exchange() -> None:
        r, s = world.Irecv(b, peer, 1), world.Isend(a, peer, 1)
        r.Wait()
        s.Wait()

    def ringpipe_exchange() -> None:
        r, s = comm.irecv(tb, peer, 1), comm.isend(ta, peer, 1)
        r.wait()
        s.wait()

    cases = [
        ("mpi4py irecv+isend+waits", raw_exchange, True),
        ("ringpipe irecv+isend+waits", ringpipe_exchange, True),
        ("ringpipe irecv+isend+waits, gc off", ringpipe_exchange, False),
        ("ringpipe allreduce (rd, checked)", lambda: collectives.allreduce(comm, x, algorithm="recursive_doubling"), True),
        ("ringpipe allreduce (rd, check=False)",
         lambda: collectives.allreduce(comm, x, algorithm="recursive_doubling", check=False), True),
        ("communicator allreduce (MPI_Allreduce)", lambda: comm.allreduce(x), True),
        ("mpi4py Allreduce", lambda: world.Allreduce(MPI.IN_PLACE, a, MPI.SUM), True),
    ]
    per_round: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for r in range(rounds):
        k = r % len(cases)
        for name, fn, collect in cases[k:] + cases[:k]:  # every case once per round, the order rotated
            (gc.enable if collect else gc.disable)()
            world.Barrier()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            per_round[name].append((time.perf_counter() - t) / calls * 1e6)
        gc.enable()
    if comm.rank == 0:
        for name, us in per_round.items():
            procs.emit({"case": name, "us": us})


def recording_overhead() -> dict[str, float]:
    """Per-operation cost of the choke point: a traced no-op against a bare call."""
    from ringpipe.comm.events import EventLog

    log = EventLog(capacity=1 << 20)
    n = 200_000

    def op() -> None:
        return None

    t0 = time.perf_counter()
    for _ in range(n):
        op()
    bare = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        ev = log.begin("send", 4, 1, 0, "world")
        try:
            op()
        finally:
            EventLog.end(ev)
    traced = time.perf_counter() - t0
    return {"per_op_overhead_us": (traced - bare) / n * 1e6}


def _run(cmd: list[str], env: dict[str, str] | None = None) -> list[dict]:
    return procs.rows(procs.run(cmd, 600, env))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--label", default="one host")
    parser.add_argument("--only", choices=["local-gloo", "local-mpi", "two-hosts-gloo", "two-hosts-mpi", "overhead",
                                           "mpi-layers"])
    parser.add_argument("--json", help="write all rows to this file")
    parser.add_argument("--repeats", type=int, default=5, help="blocks alternating native and ringpipe")
    parser.add_argument("--rounds", type=int, default=6, help="mpi-layers: rounds (every case once a round)")
    parser.add_argument("--calls", type=int, default=3000, help="mpi-layers: calls per case and round")
    parser.add_argument("--quick", action="store_true",
                        help="seconds: the overhead, local gloo at 8 B and 1 KiB in one block, mpi-layers briefly")
    parser.add_argument("--mpi-layers-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.backend, args.label, args.repeats, args.quick)
        return 0
    if args.mpi_layers_worker:
        mpi_layers_worker(args.rounds, args.calls)
        return 0
    if args.quick:
        args.repeats, args.rounds, args.calls = 1, 1, 3
    report.header("p2p", argv)
    rep = ["--repeats", str(args.repeats)] + (["--quick"] if args.quick else [])

    me = str(Path(__file__).resolve())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows: list[dict] = []
    parts = [args.only] if args.only else ["overhead", "local-gloo", "local-mpi", "two-hosts-gloo", "two-hosts-mpi"]
    if args.quick:
        parts = ["overhead", "local-gloo", "mpi-layers"]
    if "overhead" in parts:
        print(f"choke-point recording overhead: {recording_overhead()['per_op_overhead_us']:.2f} us per operation")
    if "mpi-layers" in parts and shutil.which("mpirun"):
        from ringpipe.launch import mpirun_command

        got = _run(mpirun_command(2, [sys.executable, me, "--mpi-layers-worker", "--rounds", str(args.rounds),
                                      "--calls", str(args.calls)]),
                   {**env, "RINGPIPE_STALL_CHECK_SECONDS": "0"})
        print(f"\n2 ranks under mpirun, 4 KiB, {args.rounds} rounds of {args.calls} calls each; us per call:\n")
        print(report.table(("case", "median", "min-max"),
                           [(r["case"], f"{stats.median(r['us']):.2f}", f"{min(r['us']):.2f}-{max(r['us']):.2f}")
                            for r in got], (False, True, True)))
    if "local-gloo" in parts:
        rows += _run([sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", me, "--worker",
                      "--backend", "gloo", "--label", "one host", *rep], env)
    if "local-mpi" in parts:
        from ringpipe.launch import mpirun_command

        if shutil.which("mpirun"):
            rows += _run(mpirun_command(2, [sys.executable, me, "--worker", "--backend", "mpi",
                                            "--label", "one host", *rep]), env)
    if "two-hosts-gloo" in parts:
        netns = testhelpers.module("netns")
        reason = netns.can_create()
        if reason:
            print(f"two-host part skipped: {reason}")
        else:
            with netns.two_hosts() as (a, b):
                children = []
                for node, host in enumerate((a, b)):
                    cmd = [*host.prefix(), sys.executable, "-m", "ringpipe.cli", "launch", "-n", "1",
                           "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"{a.addr}:29641",
                           me, "--worker", "--backend", "gloo", "--label", "two namespace hosts (veth)", *rep]
                    children.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                  text=True, env=env))
                for p in children:
                    out, _ = p.communicate(timeout=600)
                    rows += procs.rows(out)
    if "two-hosts-mpi" in parts and shutil.which("mpirun"):
        import tempfile

        netns = testhelpers.module("netns")
        reason = netns.can_create()
        if reason:
            print(f"two-host MPI part skipped: {reason}")
        else:
            with netns.two_hosts() as hosts, tempfile.TemporaryDirectory() as tmp:
                cmd, extra = netns.mpirun_across(hosts, [sys.executable, me, "--worker", "--backend", "mpi",
                                                         "--label", "two namespace hosts (veth)", *rep],
                                                 Path(tmp) / "hostfile")
                rows += _run(cmd, {**env, **extra})
    if rows:
        print(f"\nmedians over {args.repeats} alternating blocks; time ratio = ringpipe / native, per block\n")
        print(report.table(
            ("setup", "backend", "bytes", "native µs", "ringpipe µs", "native GB/s", "ringpipe GB/s", "time ratio",
             "ratio range"),
            [(r["setup"], r["backend"], sizes.label(r["bytes"]), f"{r['native_us']:.1f}", f"{r['ringpipe_us']:.1f}",
              f"{r['native_gbps']:.3f}", f"{r['ringpipe_gbps']:.3f}", f"{r['ratio']:.2f}",
              f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}") for r in rows],
            (False, False, True, True, True, True, True, True, True)))
        report.headline([(f"comm.send/recv one-way time, {sizes.label(r['bytes'])}, {r['setup']}",
                          f"native {r['backend']} send/recv",
                          stats.Spread(r["ratio"], r["ratio_min"], r["ratio_max"], "blocks")) for r in rows])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
