"""Point-to-point latency and bandwidth: ringpipe's communicator against the raw transport, same run.

Ping-pong between rank 0 and rank 1 for sizes from 8 B to 64 MiB: ringpipe ``comm.send/recv``
(which records every message at the choke point) against ``torch.distributed.send/recv`` (gloo)
or mpi4py ``Send/Recv`` (MPI) on the same connection, and the cost of the recording itself.
Both sides move the same buffer the same number of times; they alternate in ``--repeats``
blocks (the order swapped every block, so drift of a shared machine falls on both), and the
table gives the median over blocks and the median of the per-block time ratios with its range.

    python benchmarks/p2p.py                    # everything: gloo and MPI on one host and across two namespace hosts
    python benchmarks/p2p.py --only local-gloo  # one part
Worker mode (used by the driver): run under a launcher with ``--worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SIZES = [8, 1024, 64 * 1024, 1 << 20, 16 << 20, 64 << 20]


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


def worker(backend: str, label: str, repeats: int) -> None:
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
    for nbytes in SIZES:
        times: dict[str, list[float]] = {k: [] for k in sides}
        for block in range(repeats):
            for name in (list(sides) if block % 2 == 0 else list(sides)[::-1]):
                comm.barrier()
                times[name].append(pingpong(*sides[name], rank, nbytes))
        t_raw, t_rp = statistics.median(times["native"]), statistics.median(times["ringpipe"])
        ratios = [b / a for a, b in zip(times["native"], times["ringpipe"], strict=True)]
        rows.append({"setup": label, "backend": backend, "bytes": nbytes, "repeats": repeats,
                     "native_us": t_raw * 1e6, "ringpipe_us": t_rp * 1e6,
                     "native_gbps": nbytes / t_raw / 1e9, "ringpipe_gbps": nbytes / t_rp / 1e9,
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
    comm.log.clear()
    if rank == 0:
        for r in rows:
            print("ROW " + json.dumps(r), flush=True)
    shutdown_world()


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
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"benchmark part failed: {' '.join(cmd[:6])}")
    return _rows(out.stdout)


def _rows(text: str) -> list[dict]:
    """Rows printed by rank 0 (launchers may tag or split lines: decode each object on its own)."""
    decoder = json.JSONDecoder()
    rows = []
    for chunk in text.split("ROW ")[1:]:
        rows.append(decoder.raw_decode(chunk.lstrip())[0])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--label", default="one host")
    parser.add_argument("--only", choices=["local-gloo", "local-mpi", "two-hosts-gloo", "two-hosts-mpi", "overhead"])
    parser.add_argument("--json", help="write all rows to this file")
    parser.add_argument("--repeats", type=int, default=5, help="blocks alternating native and ringpipe")
    args = parser.parse_args()
    if args.worker:
        worker(args.backend, args.label, args.repeats)
        return
    rep = ["--repeats", str(args.repeats)]

    me = str(Path(__file__).resolve())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows: list[dict] = []
    parts = [args.only] if args.only else ["overhead", "local-gloo", "local-mpi", "two-hosts-gloo", "two-hosts-mpi"]
    if "overhead" in parts:
        print(f"choke-point recording overhead: {recording_overhead()['per_op_overhead_us']:.2f} us per operation")
    if "local-gloo" in parts:
        rows += _run([sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", me, "--worker",
                      "--backend", "gloo", "--label", "one host", *rep], env)
    if "local-mpi" in parts:
        from ringpipe.launch import mpirun_command

        if shutil.which("mpirun"):
            rows += _run(mpirun_command(2, [sys.executable, me, "--worker", "--backend", "mpi",
                                            "--label", "one host", *rep]), env)
    if "two-hosts-gloo" in parts:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import netns

        reason = netns.can_create()
        if reason:
            print(f"two-host part skipped: {reason}")
        else:
            with netns.two_hosts() as (a, b):
                procs = []
                for node, host in enumerate((a, b)):
                    cmd = [*host.prefix(), sys.executable, "-m", "ringpipe.cli", "launch", "-n", "1",
                           "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"{a.addr}:29641",
                           me, "--worker", "--backend", "gloo", "--label", "two namespace hosts (veth)", *rep]
                    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                  text=True, env=env))
                for p in procs:
                    out, _ = p.communicate(timeout=600)
                    rows += _rows(out)
    if "two-hosts-mpi" in parts and shutil.which("mpirun"):
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import netns

        reason = netns.can_create()
        if reason:
            print(f"two-host MPI part skipped: {reason}")
        else:
            with netns.two_hosts() as hosts, tempfile.TemporaryDirectory() as tmp:
                cmd, extra = netns.mpirun_across(hosts, [sys.executable, me, "--worker", "--backend", "mpi",
                                                         "--label", "two namespace hosts (veth)", *rep],
                                                 Path(tmp) / "hostfile")
                rows += _run(cmd, {**env, **extra})
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}")
    print(f"load average {os.getloadavg()[0]:.2f}; medians over {args.repeats} alternating blocks")
    print(f"{'setup':28} {'backend':7} {'bytes':>10} {'native us':>10} {'ringpipe us':>12} {'native GB/s':>11} "
          f"{'ringpipe GB/s':>13} {'time ratio':>10} {'ratio range':>12}")
    for r in rows:
        print(f"{r['setup']:28} {r['backend']:7} {r['bytes']:>10} {r['native_us']:>10.1f} {r['ringpipe_us']:>12.1f} "
              f"{r['native_gbps']:>11.3f} {r['ringpipe_gbps']:>13.3f} {r['ratio']:>10.2f} "
              f"{r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
