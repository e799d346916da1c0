"""Every dtype through every communicator operation, on real gloo and MPI processes.

Specification: uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64 and bool
work with ``allreduce`` / ``iallreduce`` (sum, average, min, max, product), ``allgather`` with a
first dimension that differs between ranks, ``broadcast`` from every root, ``alltoall``,
``reduce_scatter`` and ``reduce`` to every root, on every backend, whether or not the backend
carries the dtype itself (gloo has no int16; MPI has no float16, bfloat16 or reducible bool).
Results are exact: every rank's data is made of small integers, so the expected value
computed here in int64 / float64 from all ranks' data is the exact answer in every dtype.

Integer averages floor. A bool reduction is the reduction of the values as integers, cast
back to bool: sum and max are a logical or, min and product a logical and, average is true
where every rank is true.

Run as a script under mpirun (``mpirun -n 2 python tests/ranks/comm/test_comm_dtypes.py``) it performs
the same checks over the MPI backend.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool]
OPS = ["sum", "average", "min", "max", "product"]
#: Shapes of the reductions: a scalar, an empty tensor, a vector, a matrix.
SHAPES = [(), (0,), (7,), (3, 5)]


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: small integers whose sums and products are exact in every dtype."""
    g = torch.Generator().manual_seed(seed * 101 + rank)
    if dtype == torch.bool:
        lo, hi = 0, 2
    elif op == "product":
        lo, hi = 1, 3
    elif dtype == torch.uint8:
        lo, hi = 0, 9
    else:
        lo, hi = -8, 9
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def expected(size: int, shape: tuple[int, ...], dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    """The reduction of every rank's :func:`data`, computed exactly in int64 or float64."""
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    parts = torch.stack([data(r, shape, dtype, op, seed).to(wide) for r in range(size)])
    if op == "sum":
        out = parts.sum(0)
    elif op == "average":
        out = parts.sum(0) / size if dtype.is_floating_point else torch.div(parts.sum(0), size, rounding_mode="floor")
    elif op == "min":
        out = parts.amin(0)
    elif op == "max":
        out = parts.amax(0)
    else:
        out = parts.prod(0)
    return out.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-for-bit equal values (NaN-free data), same dtype and shape."""
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def check_dtypes(comm) -> int:  # noqa: ANN001 - a ringpipe Communicator
    """Run every dtype through every operation on ``comm``; return the number of checks."""
    p, r = comm.size, comm.rank
    checks = 0
    seed = 0
    for dtype in DTYPES:
        for op in OPS:
            for shape in SHAPES:
                seed += 1
                want = expected(p, shape, dtype, op, seed)
                t = data(r, shape, dtype, op, seed)
                assert comm.allreduce(t, op) is t
                assert same(t, want), ("allreduce", dtype, op, shape, t, want)
                t = data(r, shape, dtype, op, seed)
                assert comm.iallreduce(t, op).wait() is t
                assert same(t, want), ("iallreduce", dtype, op, shape, t, want)
                checks += 2
            seed += 1
            rows = (2 * p, 3)
            want = expected(p, rows, dtype, op, seed).chunk(p, dim=0)[r]
            t = data(r, rows, dtype, op, seed)
            keep = t.clone()
            got = comm.reduce_scatter(t, op)
            assert same(got, want), ("reduce_scatter", dtype, op, got, want)
            assert torch.equal(t, keep), ("reduce_scatter changed its input", dtype, op)
            checks += 1
            for root in range(p):
                seed += 1
                t = data(r, (4, 2), dtype, op, seed)
                comm.reduce(t, root, op)
                if r == root:
                    want = expected(p, (4, 2), dtype, op, seed)
                    assert same(t, want), ("reduce", dtype, op, root, t, want)
                checks += 1
        # allgather: rank j contributes j + 1 rows (the first dimension differs), then equal shapes
        seed += 1
        got = comm.allgather(data(r, (r + 1, 3), dtype, "sum", seed))
        assert len(got) == p
        for j in range(p):
            assert same(got[j], data(j, (j + 1, 3), dtype, "sum", seed)), ("allgather", dtype, j)
        got = comm.allgather(data(r, (2, 2), dtype, "sum", seed))
        assert all(same(got[j], data(j, (2, 2), dtype, "sum", seed)) for j in range(p)), ("allgather", dtype)
        got = comm.allgather(data(r, (), dtype, "sum", seed))
        assert all(same(got[j], data(j, (), dtype, "sum", seed)) for j in range(p)), ("allgather 0-d", dtype)
        checks += 3
        # broadcast from every root, in place
        for root in range(p):
            seed += 1
            t = data(r, (3, 4), dtype, "sum", seed)
            assert comm.broadcast(t, root) is t
            assert same(t, data(root, (3, 4), dtype, "sum", seed)), ("broadcast", dtype, root)
            checks += 1
        # alltoall: rank r sends data(r, peer) to every peer and receives data(peer, r)
        seed += 1
        sent = [data(r * p + j, (2, 3), dtype, "sum", seed) for j in range(p)]
        got = comm.alltoall(sent)
        assert all(same(got[j], data(j * p + r, (2, 3), dtype, "sum", seed)) for j in range(p)), ("alltoall", dtype)
        checks += 1
    # the values a byte view carries unchanged: every int16 bit pattern and float16 specials
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    t = every.clone() if r == 0 else torch.zeros_like(every)
    comm.broadcast(t, 0)
    assert torch.equal(t, every)
    special = torch.tensor([float("inf"), float("-inf"), -0.0, 6.0e-8, 65504.0], dtype=torch.float16)
    got = comm.allgather(special)
    assert all(torch.equal(g.view(torch.int16), special.view(torch.int16)) for g in got)
    # int16 sums wrap modulo 2^16 as int16 arithmetic does
    big = torch.full((3,), 30000, dtype=torch.int16)
    comm.allreduce(big, "sum")
    assert torch.equal(big, torch.full((3,), 30000 * p, dtype=torch.int64).to(torch.int16))
    return checks + 3


# ----------------------------------------------------------------------------- gloo processes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_dtype_every_operation_over_gloo(worlds, nprocs):
    counts = worlds.spawn(check_dtypes, nprocs)
    assert counts[0] > 400 and all(c == counts[0] for c in counts)


# ----------------------------------------------------------------------------- MPI processes


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_every_dtype_every_operation_over_mpi(mpi_jobs):
    out = mpi_jobs.run("comm_dtypes")  # this file as a script on 2 ranks
    assert out.stdout.count("comm-dtypes-mpi ok") == 2, out.stdout[-3000:]


def _mpi_main() -> None:
    from ringpipe.comm import init_world

    torch.set_num_threads(1)
    comm = init_world("mpi")
    n = check_dtypes(comm)
    print(f"comm-dtypes-mpi ok rank={comm.rank} checks={n}", flush=True)


if __name__ == "__main__":
    _mpi_main()
