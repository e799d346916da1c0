"""ringpipe's collectives against the native ones, on real gloo and MPI processes, and the mismatch check.

Run as a script under mpirun (``mpirun -n 3 python tests/test_collectives.py``) it performs
the same checks over the MPI backend.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ringpipe.collectives as C
from ringpipe.collectives.common import doubling_steps, segments
from ringpipe.collectives.header import CallInfo, HeaderState, MismatchError
from ringpipe.collectives.tree import tree_links
from ringpipe.comm import ReduceOp, default_log
from ringpipe.launch import mpirun_command, spawn

HERE = Path(__file__).resolve()
HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None

OPS = ["sum", "average", "min", "max", "product"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int32, torch.int64, torch.int8, torch.uint8]


def _sizes(p: int) -> list[int]:
    """0, 1, world-1, primes and 2^k +- 1 (and one length past the chunk size)."""
    return sorted({0, 1, p - 1, p + 1, 2, 3, 7, 13, 31, 33, 63, 65, 127, 129, 1009, 140_001})


def _data(rank: int, n: int, dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    # small integers make every reduction order exact, so results are compared bit for bit
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    lo, hi = (1, 3) if op == "product" else (0, 5) if dtype == torch.uint8 else (-4, 5)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def check_everything(comm) -> int:  # noqa: ANN001 - a ringpipe Communicator
    """Compare every algorithm with the native collective; return the number of comparisons."""
    p, r = comm.size, comm.rank
    done = 0
    seed = 0
    for n in _sizes(p):
        for dtype in DTYPES:
            ops = OPS if dtype in (torch.float32, torch.int32) else ["sum", "max"]
            if n > 2000 and dtype not in (torch.float32, torch.int64):
                continue
            for op in ops:
                seed += 1
                ref = _data(r, n, dtype, op, seed)
                comm.allreduce(ref, op)
                for algo in C.SUPPORTED["allreduce"]:
                    x = _data(r, n, dtype, op, seed)
                    C.allreduce(comm, x, op, algo)
                    assert torch.equal(x, ref), (algo, n, dtype, op)
                    done += 1
    for n in (0, 1, 5, 33, 1009, 70_001):
        seed += 1
        x = _data(r, n * p, torch.float32, "sum", seed)
        keep = x.clone()
        for op in ("sum", "max", "average"):
            assert torch.equal(C.reduce_scatter(comm, x, op, "ring"), comm.reduce_scatter(x.clone(), op))
            assert torch.equal(x, keep)
        y = _data(r, n, torch.int32, "sum", seed)
        got, want = C.allgather(comm, y, "ring"), comm.allgather(y)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        for root in range(p):
            z = _data(r, n, torch.float64, "sum", seed + root)
            want_b = comm.broadcast(z.clone(), root)
            assert torch.equal(C.broadcast(comm, z, root, "tree"), want_b)
            z = _data(r, n, torch.int64, "sum", seed + root)
            want_r = comm.reduce(z.clone(), root, "max")
            got_r = C.reduce(comm, z, root, "max", "tree")
            if r == root:
                assert torch.equal(got_r, want_r)
        done += 4 + 2 * p
    # shapes survive: a 2-D tensor stays 2-D and in place
    m = torch.full((3, 5), float(r + 1))
    assert C.allreduce(comm, m, algorithm="ring") is m and torch.all(m == p * (p + 1) / 2)
    return done


def _trace_and_hierarchy(comm) -> dict:  # noqa: ANN001
    default_log().clear()
    x = torch.ones(100_000)
    C.allreduce(comm, x, algorithm="ring")
    steps = [e for e in default_log().events() if e.op == "allreduce.step"]
    # pretend ranks {0,1} and {2,3} are two hosts: node reduce, leaders allreduce, node broadcast
    comm.topology = comm.topology.with_hostnames(["hostA", "hostA", "hostB", "hostB"])
    y = torch.arange(10.0) * (comm.rank + 1)
    algo = C.resolve("allreduce", "auto", 1 << 20, comm)
    C.allreduce(comm, y, "sum", "hierarchical")
    return {
        "steps": sorted({e.detail["step"] for e in steps}),
        "cids": {e.detail["cid"] for e in steps},
        "peers": {e.peer for e in steps},
        "has_reduce_time": any(e.detail["reduce_ns"] > 0 for e in steps),
        "bytes": sum(e.nbytes for e in steps),
        "y": y.tolist(),
        "auto": algo,
    }


def _mismatch(comm, kind: str, algo: str):  # noqa: ANN001
    n, dtype, op = 1024, torch.float32, "sum"
    if kind == "count" and comm.rank == 1:
        n = 1000
    if kind == "dtype" and comm.rank == comm.size - 1:
        dtype = torch.float64
    if kind == "op" and comm.rank == 0:
        op = "max"
    if kind == "large" and comm.rank == 1:
        n = 300_000
    try:
        if kind == "collective" and comm.rank == 1:
            C.broadcast(comm, torch.ones(n), 0)
        else:
            C.allreduce(comm, torch.ones(n, dtype=dtype), op, algo)
    except MismatchError as exc:
        return str(exc)
    return "no error"


def _one_rank_wrong(comm, kind: str):  # noqa: ANN001
    """Every rank makes the same call but one (two for "two_invalid"); returns what each raised."""
    p, r = comm.size, comm.rank
    odd = r == 1
    n, dtype, root, op, algo, extra = 64, torch.float32, 0, "sum", "auto", 0
    if kind == "rs_indivisible" and odd:
        extra = 1
    if kind in ("ar_bool", "ar_bool_large", "rs_bool") and odd:
        dtype = torch.bool
    if kind == "ar_bool_large":
        n = 300_000  # the others check the header apart from the payload
    if kind == "ag_dtype" and odd:
        dtype = torch.float64
    if kind in ("bc_bad_root", "rd_bad_root") and odd:
        root = p
    if kind == "rd_bad_root" and r == p - 1:
        root = -1
    if kind in ("bc_root", "rd_root") and odd:
        root = p - 1
    if kind == "ag_count" and odd:
        n = 63
    if kind == "rd_op" and odd:
        op = "max"
    if kind == "ar_op" and odd:
        op = "mean"
    if kind == "ar_algo" and odd:
        algo = "rign"
    if kind == "two_invalid" and r >= 1:
        root = p + r
    x = torch.ones(n * p + extra, dtype=dtype)
    if kind == "noncontiguous" and odd:
        x = torch.ones(2, n * p)[:, 0]
    try:
        if kind.startswith("rs_"):
            C.reduce_scatter(comm, x, op, algo)
        elif kind.startswith("ag_"):
            C.allgather(comm, x, algo)
        elif kind.startswith("bc_") or kind in ("two_invalid", "noncontiguous"):
            C.broadcast(comm, x, root, algo)
        elif kind.startswith("rd_"):
            C.reduce(comm, x, root, op, algo)
        else:
            C.allreduce(comm, x, op, algo)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        if not isinstance(exc, MismatchError):
            return type(exc).__name__, str(exc), []  # the peers of this rank would wait forever
        # the communicator is still usable after a refused call: nothing was left in flight
        after = torch.full((3,), float(r))
        C.allreduce(comm, after)
        return type(exc).__name__, str(exc), after.tolist()
    return "no error", "", []


# ----------------------------------------------------------------------------- single process


def test_segments_follow_baidu_split():
    assert segments(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert segments(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert segments(0, 3) == [(0, 0)] * 3


@pytest.mark.parametrize("size", range(1, 13))
def test_doubling_pattern_pairs_up(size):
    sends = {}
    for r in range(size):
        for kind, peer, step in doubling_steps(r, size):
            sends.setdefault((kind, min(r, peer), max(r, peer), step), []).append(r)
    for (kind, *_), ranks in sends.items():
        assert len(ranks) == (2 if kind == "exchange" else 1)
    for r in range(size):  # every send has its receive
        for kind, peer, step in doubling_steps(r, size):
            mate = {"send": "recv", "send_result": "recv_result", "exchange": "exchange"}.get(kind)
            if mate:
                assert (mate, r, step) in [(k, q, s) for k, q, s in doubling_steps(peer, size)]


@pytest.mark.parametrize("size", range(1, 10))
def test_binomial_tree_reaches_everyone(size):
    for root in range(size):
        links = {r: tree_links(r, size, root) for r in range(size)}
        assert links[root][0] is None
        for r, (_parent, children) in links.items():
            for c in children:
                assert links[c][0] == r
        assert sum(len(c) for _, c in links.values()) == size - 1


def test_unknown_algorithm_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid algorithms: auto, ring, rabenseifner"):
        C.resolve("allreduce", "bogus", 4, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="broadcast algorithm 'ring'"):
        C.resolve("broadcast", "ring", 4, None)  # type: ignore[arg-type]
    assert set(C.ALGORITHMS) >= {a for v in C.SUPPORTED.values() for a in v}


def test_header_roundtrip_and_message():
    a = CallInfo.make(17, "allreduce", ReduceOp.SUM, torch.float32, 1024, -1, "auto")
    b = CallInfo.make(17, "allreduce", ReduceOp.SUM, torch.float32, 1000, -1, "auto")
    buf = torch.empty(256, dtype=torch.uint8)
    HeaderState(1, b).write(buf)
    mine = HeaderState(0, a)
    assert not mine.absorb(buf, 1)
    with pytest.raises(MismatchError, match=r"allreduce #17: rank 0 has float32\[1024\], rank 1 has float32\[1000\]"):
        mine.raise_if_mismatch()
    with pytest.raises(Exception, match="bool -> uint8"):
        CallInfo.make(1, "allreduce", ReduceOp.SUM, torch.bool, 3, -1, "auto")


# ----------------------------------------------------------------------------- gloo processes


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_equal_to_native_over_gloo(nprocs):
    counts = spawn(check_everything, nprocs)
    assert all(c == counts[0] and c > 500 for c in counts)


@pytest.mark.timeout(60)
def test_step_trace_and_hierarchical_over_two_fake_nodes():
    out = spawn(_trace_and_hierarchy, 4)
    for res in out:
        assert res["steps"] == list(range(6))  # 2(p-1) ring steps
        assert len(res["cids"]) == 1 and res["has_reduce_time"]
        assert res["bytes"] > 0 and len(res["peers"]) == 1  # every step receives from r-1
        assert res["y"] == [10.0 * i for i in range(10)]  # (1+2+3+4) * arange
        assert res["auto"] == "hierarchical"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("nprocs", "kind", "algo", "pattern"), [
    (2, "count", "auto", r"allreduce #1: rank 0 has float32\[1024\], rank 1 has float32\[1000\]"),
    (4, "count", "ring", r"allreduce #1: rank 0 has float32\[1024\], rank 1 has float32\[1000\]"),
    (3, "dtype", "recursive_doubling", r"rank \d has float\d+\[1024\], rank 2 has float64\[1024\]"),
    (4, "op", "rabenseifner", r"rank 0 has float32\[1024\] op=max, rank 1 has float32\[1024\] op=sum"),
    (4, "large", "auto", r"rank 0 has float32\[1024\], rank 1 has float32\[300000\]"),
    (3, "collective", "auto", r"collective #1: rank 0 has allreduce #1 of float32\[1024\]"),
])
def test_mismatch_raises_on_every_rank(nprocs, kind, algo, pattern):
    import re

    messages = spawn(_mismatch, nprocs, args=(kind, algo))
    for msg in messages:
        assert re.search(pattern, msg), msg


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("nprocs", "kind", "error", "pattern"), [
    (3, "rs_indivisible", "InvalidCallError",
     r"reduce_scatter #1: rank 1 made an invalid call: reduce_scatter: first dimension \(193,\) "
     r"must be divisible by the number of ranks 3; pad the tensor"),
    (2, "rs_bool", "InvalidCallError", r"reduce_scatter #1: rank 1 .*dtype torch.bool is not supported"),
    (3, "ar_bool", "InvalidCallError", r"allreduce #1: rank 1 .*dtype torch.bool .*bool -> uint8"),
    (4, "ar_bool_large", "InvalidCallError", r"allreduce #1: rank 1 .*dtype torch.bool"),
    (3, "ar_op", "InvalidCallError", r"allreduce #1: rank 1 .*unknown reduce op 'mean'"),
    (4, "ar_algo", "InvalidCallError", r"allreduce #1: rank 1 .*unknown allreduce algorithm 'rign'"),
    (3, "bc_bad_root", "InvalidCallError", r"broadcast #1: rank 1 .*root 3 is not a rank of world \(size 3\)"),
    (4, "rd_bad_root", "InvalidCallError", r"reduce #1: rank 1 .*root 4 is not a rank"),
    (4, "two_invalid", "InvalidCallError", r"broadcast #1: rank 1 .*root 5 is not a rank"),
    (2, "noncontiguous", "InvalidCallError", r"broadcast #1: rank 1 .*must be contiguous"),
    (3, "ag_dtype", "MismatchError", r"allgather #1: rank 0 has float32\[192\], rank 1 has float64\[192\]"),
    (3, "ag_count", "MismatchError", r"allgather #1: rank 0 has float32\[192\], rank 1 has float32\[189\]"),
    (4, "bc_root", "MismatchError", r"broadcast #1: rank 0 has float32\[256\] root=0, rank 1 has float32\[256\] root=3"),
    (3, "rd_root", "MismatchError", r"reduce #1: rank 0 has float32\[192\] root=0, rank 1 has float32\[192\] root=2"),
    (3, "rd_op", "MismatchError", r"reduce #1: rank 0 has float32\[192\] op=sum, rank 1 has float32\[192\] op=max"),
])
def test_one_wrong_rank_raises_on_every_rank(nprocs, kind, error, pattern):
    import re

    out = spawn(_one_rank_wrong, nprocs, args=(kind,))
    for rank, (name, msg, after) in enumerate(out):
        assert name == error, (rank, name, msg)
        assert re.search(pattern, msg), (rank, msg)
        assert after == [sum(range(nprocs))] * 3
    if error == "InvalidCallError":
        assert len({msg for _, msg, _ in out}) == 1  # the same text on every rank


@pytest.mark.timeout(90)
def test_bench_cli_under_torchrun(tmp_path):
    png = tmp_path / "busbw.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_port()), "-m", "ringpipe.cli", "bench", "allreduce",
           "-b", "4K", "-e", "64K", "-f", "4", "-n", "2", "-w", "1", "--json", "--plot", str(png)]
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGPIPE_BACKEND="gloo")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=80, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["algorithm"] for r in rows} == set(C.SUPPORTED["allreduce"])
    assert {r["bytes"] for r in rows} == {4096, 16384, 65536}
    for r in rows:
        assert r["wrong"] == 0 and r["backend"] == "gloo" and r["busbw_gbps"] > 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"], rel=1e-3)  # factor 2(p-1)/p = 1
    assert png.stat().st_size > 1000


def _port() -> int:
    from ringpipe.comm.world import free_port

    return free_port("127.0.0.1")


# ----------------------------------------------------------------------------- MPI processes


@pytest.mark.mpi
@pytest.mark.timeout(150)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_equal_to_native_over_mpi(nprocs):
    cmd = mpirun_command(nprocs, [sys.executable, str(HERE)])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("collectives-mpi ok") == nprocs
    assert out.stdout.count("mismatch caught") == nprocs


def _mpi_main() -> None:
    from ringpipe.comm import init_world

    torch.set_num_threads(1)
    comm = init_world("mpi")
    n = check_everything(comm)
    msg = _mismatch(comm, "count", "auto")
    assert "rank 1 has float32[1000]" in msg, msg
    print(f"mismatch caught on rank {comm.rank}", flush=True)
    print(f"collectives-mpi ok rank={comm.rank} comparisons={n}", flush=True)


if __name__ == "__main__":
    _mpi_main()
