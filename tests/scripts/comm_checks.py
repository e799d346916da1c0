"""Every communicator operation checked against a locally computed reference (run in each rank).

Imported by the tests under ``ringpipe.launch.spawn`` and run as a script under ``mpirun``,
``torchrun`` and ``ringpipe launch``.
"""

from __future__ import annotations

import os
import sys

import torch

from ringpipe.comm import CommError, Communicator, ReduceOp

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]
SHAPES = [(0,), (1,), (7,), (3, 5), (2, 3, 4)]


def rank_tensor(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.float64).reshape(shape) % 5 + 1 + rank
    return base.to(dtype)


def reference(op: ReduceOp, size: int, shape, dtype) -> torch.Tensor:
    parts = torch.stack([rank_tensor(r, shape, torch.float64) for r in range(size)])
    if op is ReduceOp.SUM:
        out = parts.sum(0)
    elif op is ReduceOp.AVERAGE:
        out = parts.sum(0) / size
        if not dtype.is_floating_point:
            out = torch.floor(out)
    elif op is ReduceOp.MIN:
        out = parts.min(0).values
    elif op is ReduceOp.MAX:
        out = parts.max(0).values
    else:
        out = parts.prod(0)
    return out.to(dtype)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (torch.float16, torch.bfloat16):
        return torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-2)
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    return torch.equal(a, b)


def check_all(comm: Communicator) -> int:
    """Run every operation; return the number of checks made (raises on the first wrong one)."""
    r, n = comm.rank, comm.size
    checks = 0

    def expect(cond: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not cond:
            raise AssertionError(f"rank {r}: {what}")

    for dtype in DTYPES:
        for shape in SHAPES:
            for op in ReduceOp:
                if op is ReduceOp.ADASUM or op is ReduceOp.PRODUCT and dtype in (torch.float16, torch.bfloat16):
                    continue  # adasum is ringpipe.collectives' own algorithm (tests/ranks/collectives/test_adasum.py)
                t = rank_tensor(r, shape, dtype)
                comm.allreduce(t, op)
                expect(close(t, reference(op, n, shape, dtype)), f"allreduce {op} {dtype} {shape}")
            t = rank_tensor(r, shape, dtype)
            w = comm.iallreduce(t, "sum")
            expect(close(w.wait(), reference(ReduceOp.SUM, n, shape, dtype)), f"iallreduce {dtype} {shape}")
            # broadcast from the last rank
            t = rank_tensor(r, shape, dtype)
            comm.broadcast(t, root=n - 1)
            expect(close(t, rank_tensor(n - 1, shape, dtype)), f"broadcast {dtype} {shape}")
            # reduce to rank 0
            t = rank_tensor(r, shape, dtype)
            comm.reduce(t, root=0, op="max")
            if r == 0:
                expect(close(t, reference(ReduceOp.MAX, n, shape, dtype)), f"reduce {dtype} {shape}")
        # allgather with equal and with different first dimensions
        g = comm.allgather(rank_tensor(r, (2, 3), dtype))
        expect(all(close(g[i], rank_tensor(i, (2, 3), dtype)) for i in range(n)), f"allgather {dtype}")
        g = comm.allgather(rank_tensor(r, (r + 1, 2), dtype))
        expect([x.shape[0] for x in g] == list(range(1, n + 1)), f"allgather-v shapes {dtype}")
        expect(all(close(g[i], rank_tensor(i, (i + 1, 2), dtype)) for i in range(n)), f"allgather-v {dtype}")
        # reduce_scatter: block r of the sum
        t = rank_tensor(r, (2 * n, 3), dtype)
        out = comm.reduce_scatter(t, "sum")
        full = reference(ReduceOp.SUM, n, (2 * n, 3), dtype)
        expect(close(out, full.chunk(n)[r]), f"reduce_scatter {dtype}")
        # alltoall: rank r sends (r*10 + j) to j
        send = [torch.full((3,), r * 10 + j).to(dtype) for j in range(n)]
        got = comm.alltoall(send)
        expect(all(close(got[j], torch.full((3,), j * 10 + r).to(dtype)) for j in range(n)), f"alltoall {dtype}")
        # ring of point-to-point messages, blocking and non-blocking
        right, left = (r + 1) % n, (r - 1) % n
        buf = torch.empty(4, dtype=dtype)
        sw = comm.isend(rank_tensor(r, (4,), dtype), right, tag=3)
        rw = comm.irecv(buf, left, tag=3)
        rw.wait()
        sw.wait()
        expect(rw.is_completed() and close(buf, rank_tensor(left, (4,), dtype)), f"isend/irecv {dtype}")
        if r % 2 == 0:
            comm.send(rank_tensor(r, (5,), dtype), right)
            comm.recv(buf2 := torch.empty(5, dtype=dtype), left)
        else:
            comm.recv(buf2 := torch.empty(5, dtype=dtype), left)
            comm.send(rank_tensor(r, (5,), dtype), right)
        expect(close(buf2, rank_tensor(left, (5,), dtype)), f"send/recv {dtype}")

    comm.barrier()
    expect(comm.broadcast_object({"from": r, "x": [1, 2]}, root=n - 1) == {"from": n - 1, "x": [1, 2]}, "bcast obj")
    expect(comm.allgather_object(("r", r)) == [("r", i) for i in range(n)], "allgather obj")

    # sub-communicators: even ranks, and the node / leaders communicators
    evens = comm.split(list(range(0, n, 2)))
    if r % 2 == 0:
        assert evens is not None
        t = torch.ones(3) * r
        evens.allreduce(t)
        expect(torch.equal(t, torch.ones(3) * sum(range(0, n, 2))), "split allreduce")
        expect(evens.global_ranks == list(range(0, n, 2)) and evens.rank == r // 2, "split ranks")
    else:
        expect(evens is None, "non-member gets None")
    node = comm.node_comm()
    expect(node.size == comm.topology.local_size, "node comm size")
    leaders = comm.leaders_comm()
    expect((leaders is not None) == (node.rank == 0), "leaders membership")

    # bad input: wrong peers and roots are refused before touching the transport
    for bad in (lambda: comm.send(torch.ones(1), n), lambda: comm.isend(torch.ones(1), r),
                lambda: comm.broadcast(torch.ones(1), root=n), lambda: comm.allreduce(torch.ones(4)[::2]),
                lambda: comm.allreduce(torch.ones(1), op="mean")):
        try:
            bad()
        except (CommError, ValueError):
            checks += 1
        else:
            raise AssertionError(f"rank {r}: bad input was accepted")
    return checks


if __name__ == "__main__":
    from ringpipe.comm import init_world, shutdown_world

    world = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
    count = check_all(world)
    print(f"comm-checks ok rank={world.rank} size={world.size} launcher={world.topology.launcher} checks={count}",
          flush=True)
    shutdown_world()
    sys.exit(0)
