"""Adasum on real gloo and MPI processes against the paper's formula computed in one process.

Specification (Maleki et al., MLSys 2021; Horovod's CPU Adasum): two vectors combine as
``(1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b`` (coefficient 1 where ``|x|^2 < sqrt(DBL_MIN)``),
and ``2^k`` ranks combine as a tree over rank order: ``adasum(adasum(g0, g1), adasum(g2, g3))``.
Several tensors in one call are combined each with its own dot products. Orthogonal vectors
add up; parallel ones average. Only float16, float32 and float64; only powers of two ranks
(``NotImplementedError`` as in Horovod); every bad or mismatched call raises on every rank
and the next collective works.

Run as a script under mpirun (``mpirun -n 4 python tests/ranks/collectives/test_adasum.py``) it performs the
same checks over the MPI backend.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

import ringpipe.collectives as C
from ringpipe.check.call import InvalidCallError, MismatchError
from ringpipe.comm.base import CommError

HERE = Path(__file__).resolve()
HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None

DTYPES = [torch.float16, torch.float32, torch.float64]
#: Lengths below, at and above the number of ranks, odd ones, one past a chunk, and a matrix.
SHAPES = [(0,), (1,), (3,), (7,), (1009,), (33, 17), (70_001,)]
FUSED = [(5,), (0,), (4, 3), (1,), (300,), (2,)]
#: Bound on |result - reference| / |reference| (a few roundings to the dtype).
TOLERANCE = {torch.float16: 4e-3, torch.float32: 1e-6, torch.float64: 1e-12}


# ----------------------------------------------------------------------------- the reference


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The paper's combination of two float64 vectors, with Horovod's guard for tiny norms."""
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    tiny = 2.2250738585072014e-308 ** 0.5
    ca = 1 - dot / (2 * aa) if aa >= tiny else 1.0
    cb = 1 - dot / (2 * bb) if bb >= tiny else 1.0
    return ca * a + cb * b


def tree(vectors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Combine 2^k vectors pairwise in rank order, level by level (rounded to ``dtype`` after each)."""
    level = [v.double().reshape(-1) for v in vectors]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        if dtype is not None:
            level = [v.to(dtype).double() for v in level]
    return level[0]


def gradient(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    got, want = got.double().reshape(-1), want.double().reshape(-1)
    scale = float(want.norm())
    return got.shape == want.shape and float((got - want).norm()) <= TOLERANCE[dtype] * max(scale, 1e-300)


# ----------------------------------------------------------------------------- in every rank


def run_cases(comm) -> dict:  # noqa: ANN001 - a ringpipe Communicator
    """Adasum of known per-rank data; returns what every case produced on this rank."""
    r = comm.rank
    out: dict = {}
    for dtype in DTYPES:
        for seed, shape in enumerate(SHAPES):
            t = gradient(r, shape, dtype, seed)
            assert C.adasum_allreduce(comm, t) is t and t.shape == shape and t.dtype == dtype
            out[("plain", dtype, shape)] = t
        fused = [gradient(r, s, dtype, 50 + i) for i, s in enumerate(FUSED)]
        got = C.adasum_allreduce(comm, fused)
        assert all(g is f for g, f in zip(got, fused, strict=True))
        out[("fused", dtype)] = fused
        t = gradient(r, (257,), dtype, 77)
        assert C.allreduce(comm, t, "adasum") is t
        out[("op", dtype)] = t
    # orthogonal vectors add up, parallel ones average (Horovod's own Adasum tests)
    q, _ = torch.linalg.qr(torch.randn(64, comm.size, generator=torch.Generator().manual_seed(3),
                                       dtype=torch.float64))
    out["orthogonal"] = C.adasum_allreduce(comm, q[:, r].clone())
    base = torch.randn(64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out["parallel"] = C.adasum_allreduce(comm, base * (r + 1.5))
    # a zero gradient leaves the other one unchanged; all zeros stay zeros; tiny norms just add
    out["zero"] = C.adasum_allreduce(comm, gradient(r, (9,), torch.float32, 5) * (r % 2))
    out["zeros"] = C.adasum_allreduce(comm, torch.zeros(6, dtype=torch.float16))
    out["tiny"] = C.adasum_allreduce(comm, gradient(r, (8,), torch.float64, 6) * 1e-80)
    return out


def verify(out: dict, size: int) -> int:
    """Compare one rank's results with the reference; return the number of comparisons."""
    n = 0
    for dtype in DTYPES:
        for seed, shape in enumerate(SHAPES):
            parts = [gradient(j, shape, dtype, seed) for j in range(size)]
            got = out[("plain", dtype, shape)]
            assert close(got, tree(parts), dtype), ("plain", dtype, shape)
            assert close(got, tree(parts, dtype), dtype), ("plain, rounded per level", dtype, shape)
            n += 1
        for i, s in enumerate(FUSED):  # each tensor of a fused call as if reduced alone
            parts = [gradient(j, s, dtype, 50 + i) for j in range(size)]
            assert close(out[("fused", dtype)][i], tree(parts), dtype), ("fused", dtype, s)
            n += 1
        parts = [gradient(j, (257,), dtype, 77) for j in range(size)]
        assert close(out[("op", dtype)], tree(parts), dtype)
        n += 1
    q, _ = torch.linalg.qr(torch.randn(64, size, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    assert close(out["orthogonal"], q.sum(1), torch.float64)
    base = torch.randn(64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert close(out["parallel"], base * sum(j + 1.5 for j in range(size)) / size, torch.float64)
    zero = [gradient(j, (9,), torch.float32, 5) * (j % 2) for j in range(size)]
    assert close(out["zero"], tree(zero), torch.float32)
    if size == 2:
        assert torch.equal(out["zero"], zero[1])
    assert torch.equal(out["zeros"], torch.zeros(6, dtype=torch.float16))
    tiny = [gradient(j, (8,), torch.float64, 6) * 1e-80 for j in range(size)]
    assert close(out["tiny"], sum(tiny), torch.float64)  # below sqrt(DBL_MIN): coefficients 1
    return n + 5


def _same_on_every_rank(outs: list[dict]) -> None:
    for key, value in outs[0].items():
        for other in outs[1:]:
            mine = value if isinstance(value, list) else [value]
            theirs = other[key] if isinstance(other[key], list) else [other[key]]
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), key


# ----------------------------------------------------------------------------- the reference itself


def test_reference_pair_is_the_papers_formula():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert torch.equal(pair(a.double(), b.double()), torch.tensor([1.0, 2.0], dtype=torch.float64))
    a = torch.tensor([2.0, 2.0], dtype=torch.float64)
    assert torch.allclose(pair(a, 3 * a), 2 * a)  # parallel: the average
    a, b = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 1.0], dtype=torch.float64)
    # a.b = 1, |a|^2 = 1, |b|^2 = 2: (1 - 1/2) a + (1 - 1/4) b
    assert torch.allclose(pair(a, b), 0.5 * a + 0.75 * b)


# ----------------------------------------------------------------------------- gloo processes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_adasum_equals_the_reference_over_gloo(worlds, nprocs):
    outs = worlds.spawn(run_cases, nprocs)
    for out in outs:
        assert verify(out, nprocs) > 30
    _same_on_every_rank(outs)


def _groups(comm) -> torch.Tensor:  # noqa: ANN001
    """Adasum inside a sub-communicator: ranks are numbered within it."""
    evens, odds = comm.split([0, 2]), comm.split([3, 1])
    sub = evens if evens is not None else odds
    t = gradient(comm.rank, (101,), torch.float32, 9)
    return C.adasum_allreduce(sub, t)


@pytest.mark.timeout(200)
def test_adasum_inside_sub_communicators(worlds):
    outs = worlds.spawn(_groups, 4)
    g = [gradient(j, (101,), torch.float32, 9) for j in range(4)]
    assert close(outs[0], tree([g[0], g[2]]), torch.float32) and torch.equal(outs[0], outs[2])
    assert close(outs[1], tree([g[1], g[3]]), torch.float32) and torch.equal(outs[1], outs[3])


def _errors(comm) -> list[str]:  # noqa: ANN001
    """Every bad or mismatched call on 2 ranks: what each raised, and that the next call works."""
    r = comm.rank
    seen = []

    def expect(kind, fn):  # noqa: ANN001, ANN202
        with pytest.raises(kind) as info:
            fn()
        seen.append(f"{type(info.value).__name__}: {info.value}")
        t = torch.full((5,), float(r + 1))
        C.allreduce(comm, t, "sum")  # the world is still usable
        assert torch.equal(t, torch.full((5,), 3.0))

    expect(InvalidCallError, lambda: C.adasum_allreduce(comm, torch.ones(4, dtype=torch.int32)))
    expect(InvalidCallError, lambda: C.adasum_allreduce(comm, torch.ones(4, dtype=torch.bfloat16 if r else torch.float32)))
    expect(InvalidCallError, lambda: C.adasum_allreduce(comm, [torch.ones(2), torch.ones(2, dtype=torch.float64)]))
    expect(InvalidCallError, lambda: C.adasum_allreduce(comm, []))
    expect(InvalidCallError, lambda: C.adasum_allreduce(comm, torch.ones(4, 4).t()))
    expect(MismatchError, lambda: C.adasum_allreduce(comm, torch.ones(4 + r)))
    expect(MismatchError, lambda: C.adasum_allreduce(comm, torch.ones((2, 3) if r else (3, 2))))
    expect(MismatchError, lambda: C.adasum_allreduce(comm, torch.ones(4, dtype=torch.float64 if r else torch.float32)))
    expect(MismatchError, lambda: C.allreduce(comm, torch.ones(4), "sum" if r else "adasum"))
    expect(InvalidCallError, lambda: C.allreduce(comm, torch.ones(4), "adasum", "ring"))
    expect(InvalidCallError, lambda: C.reduce_scatter(comm, torch.ones(4), "adasum"))
    expect(InvalidCallError, lambda: C.reduce(comm, torch.ones(4), 0, "adasum"))
    expect(CommError, lambda: comm.allreduce(torch.ones(4), "adasum"))
    return seen


@pytest.mark.timeout(200)
def test_bad_and_mismatched_calls_raise_on_every_rank(worlds):
    seen = worlds.spawn(_errors, 2)
    assert seen[0] == seen[1], "every rank raises the same error"
    text = "\n".join(seen[0])
    for fragment in ("Adasum reduces float16, float32, float64 tensors, not int32",
                     "rank 1 made an invalid call", "different dtypes (float32, float64)",
                     "no tensors given", "contiguous",
                     "op=adasum", "only available for allreduce", "runs its own algorithm",
                     "no native adasum reduction"):
        assert fragment in text, (fragment, text)
    assert seen[0][5].startswith("MismatchError") and "[4]" in seen[0][5] and "[5]" in seen[0][5]


def _three(comm) -> list[str]:  # noqa: ANN001
    seen = []
    for call in (lambda: C.adasum_allreduce(comm, torch.ones(4)),
                 lambda: C.allreduce(comm, torch.ones(4), "adasum")):
        with pytest.raises(NotImplementedError) as info:
            call()
        seen.append(str(info.value))
    t = torch.ones(3)
    C.allreduce(comm, t)
    assert torch.equal(t, torch.full((3,), 3.0))
    return seen


@pytest.mark.timeout(200)
def test_non_power_of_two_ranks_raise_horovods_error_on_every_rank(worlds):
    seen = worlds.spawn(_three, 3)
    assert seen[0] == seen[1] == seen[2]
    assert all("Running Adasum with non-power of 2 ranks is not supported yet" in s for s in seen[0])
    assert "has 3 ranks" in seen[0][0]


# ----------------------------------------------------------------------------- MPI processes


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_adasum_equals_the_reference_over_mpi_on_four_ranks(mpi_jobs):
    out = mpi_jobs.run("adasum")  # this file as a script on 4 ranks (--oversubscribe where cores are fewer)
    assert out.stdout.count("adasum-mpi ok") == 4, out.stdout[-3000:]


def _mpi_main() -> None:
    from ringpipe.comm import init_world

    torch.set_num_threads(1)
    comm = init_world("mpi")
    out = run_cases(comm)
    n = verify(out, comm.size)
    mine = torch.cat([v.double().reshape(-1) for v in out.values() if isinstance(v, torch.Tensor)])
    every = comm.allgather(mine)
    assert all(torch.equal(e, mine) for e in every), "the same result on every rank"
    print(f"adasum-mpi ok rank={comm.rank} checks={n}", flush=True)


if __name__ == "__main__":
    _mpi_main()
