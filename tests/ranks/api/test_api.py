"""The Horovod-style API on real processes (gloo and MPI), its gradients, and the example script."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

import ringpipe.api as hvd
from ringpipe.comm import shutdown_world
from ringpipe.launch import spawn

HERE = Path(__file__).resolve().parents[2]  # tests/: the helper scripts and modules
EXAMPLE = HERE.parent / "examples" / "horovod_mnist_style.py"
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None


def api_checks(comm) -> int:
    """Every API call against a locally computed value; returns the number of checks."""
    hvd.init(comm=comm)
    try:
        return _checks()
    finally:
        hvd.shutdown()


def _checks() -> int:
    r, n = hvd.rank(), hvd.size()
    done = 0

    def ok(cond, what):
        nonlocal done
        assert cond, f"rank {r}: {what}"
        done += 1

    ok(hvd.is_initialized() and n >= 2, "initialised")
    ok(hvd.local_rank() == r and hvd.local_size() == n, "local rank/size")
    ok(hvd.cross_rank() == 0 and hvd.cross_size() == 1, "cross rank/size")
    ranks = torch.arange(n, dtype=torch.float64)
    x = torch.tensor([1.0, 2.0], dtype=torch.float64) * (r + 1)
    base = torch.tensor([1.0, 2.0], dtype=torch.float64)
    ok(torch.allclose(hvd.allreduce(x), base * (ranks + 1).mean()), "allreduce average")
    ok(torch.allclose(hvd.allreduce(x, op=hvd.Sum), base * (ranks + 1).sum()), "sum")
    ok(torch.allclose(hvd.allreduce(x, average=False), base * (ranks + 1).sum()), "average=False")
    ok(torch.allclose(hvd.allreduce(x, op=hvd.Min), base), "min")
    ok(torch.allclose(hvd.allreduce(x, op=hvd.Max), base * n), "max")
    ok(torch.allclose(hvd.allreduce(x, op=hvd.Product), base ** n * torch.prod(ranks + 1)), "product")
    ok(torch.allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                      base * (ranks + 1).sum()), "scale factors")
    ok(torch.equal(x, base * (r + 1)), "allreduce is out of place")
    y = x.clone()
    ok(hvd.allreduce_(y, op=hvd.Sum) is y and torch.allclose(y, base * (ranks + 1).sum()), "allreduce_")
    h = hvd.allreduce_async(x, op=hvd.Sum)
    out = hvd.synchronize(h)
    ok(hvd.poll(h) and torch.allclose(out, base * (ranks + 1).sum()), "allreduce_async")
    z = x.clone()
    out = hvd.synchronize(hvd.allreduce_async_(z, op=hvd.Max))
    ok(out is z and torch.allclose(z, base * n), "allreduce_async_")
    g = [torch.ones(3) * r, torch.ones(2, 2) * r]
    outs = hvd.grouped_allreduce(g, op=hvd.Sum)
    ok(all(torch.allclose(o, torch.full_like(o, sum(range(n)))) for o in outs), "grouped_allreduce")
    outs = hvd.synchronize(hvd.grouped_allreduce_async_(g))
    ok(outs[0] is g[0] and torch.allclose(g[1], torch.full((2, 2), sum(range(n)) / n)), "grouped_allreduce_async_")
    # allgather with different first dimensions
    mine = torch.full((r + 1, 2), float(r))
    want = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)])
    ok(torch.equal(hvd.allgather(mine), want), "allgather")
    ok(torch.equal(hvd.synchronize(hvd.allgather_async(mine)), want), "allgather_async")
    b = torch.full((3,), float(r))
    ok(torch.equal(hvd.broadcast(b, 1), torch.ones(3)) and torch.equal(b, torch.full((3,), float(r))), "broadcast")
    ok(hvd.broadcast_(b, 1) is b and torch.equal(b, torch.ones(3)), "broadcast_")
    ok(torch.equal(hvd.synchronize(hvd.broadcast_async(torch.full((2,), float(r)), 0)), torch.zeros(2)),
       "broadcast_async")
    # reducescatter: dim 0 = 2n+1 rows, the first rank gets the extra one
    rows = 2 * n + 1
    t = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (r + 1)
    full = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * sum(k + 1 for k in range(n)) / n
    start = 2 * r + (1 if r > 0 else 0)
    ok(torch.allclose(hvd.reducescatter(t), full[start : start + (3 if r == 0 else 2)]), "reducescatter")
    even = torch.ones(2 * n, 3) * (r + 1)
    ok(torch.allclose(hvd.synchronize(hvd.reducescatter_async(even, op=hvd.Sum)),
                      torch.full((2, 3), float(sum(k + 1 for k in range(n))))), "reducescatter_async")
    # alltoall with uneven splits: rank r sends (j + 1) rows of value 10r + j to rank j
    splits = [j + 1 for j in range(n)]
    send = torch.cat([torch.full((j + 1, 2), 10.0 * r + j) for j in range(n)])
    recv, got = hvd.alltoall(send, splits=splits)
    ok(got.tolist() == [r + 1] * n, "alltoall received splits")
    ok(torch.equal(recv, torch.cat([torch.full((r + 1, 2), 10.0 * k + r) for k in range(n)])), "alltoall")
    even = torch.arange(n, dtype=torch.float32) + 100 * r
    ok(torch.equal(hvd.alltoall(even), torch.tensor([100.0 * k + r for k in range(n)])), "alltoall even")
    hvd.barrier()
    ok(hvd.broadcast_object({"a": r}, root_rank=1) == {"a": 1}, "broadcast_object")
    ok(hvd.allgather_object(("x", r)) == [("x", k) for k in range(n)], "allgather_object")
    done += _gradients(r, n)
    ok(hvd.join() == n - 1, "join with no optimizer: every rank joined together")
    return done


def _gradients(r: int, n: int) -> int:
    """Autograd through the collectives, with Horovod's gradient conventions (horovod/torch/mpi_ops.py)."""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    (hvd.allreduce(w * (r + 1), op=hvd.Sum) * torch.tensor([1.0, -1.0])).sum().backward()
    # d/dw sum_k <allreduce(w (k+1)), c> on rank r = (r + 1) * n * c
    assert torch.allclose(w.grad, (r + 1) * n * torch.tensor([1.0, -1.0])), "allreduce grad"
    w = torch.tensor([3.0], requires_grad=True)
    gathered = hvd.allgather(w * (r + 1))
    (gathered * torch.arange(1.0, n + 1)).sum().backward()
    # Horovod: the output gradient averaged over ranks (arange(1, n+1) everywhere), this rank's row
    assert torch.allclose(w.grad, torch.tensor([(r + 1.0) * (r + 1)])), "allgather grad"
    w = torch.tensor([2.0], requires_grad=True)
    hvd.broadcast(w, 0).sum().backward()
    # Horovod: the averaged output gradient on the root, zero elsewhere
    assert torch.allclose(w.grad, torch.tensor([1.0 if r == 0 else 0.0])), "broadcast grad"
    w = torch.ones(2 * n, requires_grad=True)
    hvd.reducescatter(w, op=hvd.Sum).sum().backward()
    # Horovod: the allgather of the output gradients, times the size for Sum
    assert torch.allclose(w.grad, torch.full((2 * n,), float(n))), "reducescatter grad"
    w = torch.ones(n, requires_grad=True)
    (hvd.alltoall(w) * (r + 1)).sum().backward()
    # element j goes to rank j, whose loss weighs it by (j + 1)
    assert torch.allclose(w.grad, torch.arange(1.0, n + 1)), "alltoall grad"
    return 5


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_api_on_gloo(worlds, nprocs):
    assert all(c >= 30 for c in worlds.spawn(api_checks, nprocs))


def test_api_before_init_is_an_error():
    assert not hvd.is_initialized()
    with pytest.raises(hvd.NotInitializedError, match=r"call ringpipe.init\(\) first"):
        hvd.rank()
    hvd.init(backend="gloo")  # one process, from the (empty) environment
    try:
        assert hvd.size() == 1 and hvd.rank() == 0 and hvd.gloo_enabled()
        assert torch.equal(hvd.allreduce(torch.ones(2)), torch.ones(2))
    finally:
        hvd.shutdown()
        shutdown_world()
    assert not hvd.is_initialized()


def mpi_main() -> None:
    from ringpipe.comm import init_world

    count = api_checks(init_world("mpi"))
    print(f"api-checks ok {count}", flush=True)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_api_on_mpi(mpi_jobs):
    out = mpi_jobs.run("api")  # mpi_main() above on 2 ranks
    assert out.stdout.count("api-checks ok") == 2


# ----------------------------------------------------------------------------- the example


def _run_example(comm, argv):
    shutdown_world()  # the script calls hvd.init() itself, from the environment spawn set
    sys.argv = [str(EXAMPLE), *argv]
    names = runpy.run_path(str(EXAMPLE), run_name="__main__")
    return str(next(names["model"].parameters()).device)


def _accuracies(text: str) -> list[float]:
    return [float(a) for a in re.findall(r"test accuracy ([0-9.]+)%", text)]


@pytest.mark.timeout(120)
def test_example_runs_on_gloo(tmp_path, capfd):
    ck = tmp_path / "ck.pt"
    argv = ["--epochs", "3", "--checkpoint", str(ck), "--no-cuda"]
    # fresh ranks: capfd reads what rank 0 prints, which a kept world's ranks would print elsewhere
    assert spawn(_run_example, 2, args=(argv,)) == ["cpu", "cpu"]
    acc = _accuracies(capfd.readouterr().out)
    assert len(acc) == 3 and acc[-1] > 50.0, acc  # rank 0 prints once per epoch
    assert torch.load(ck, weights_only=False)["epoch"] == 2


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_example_runs_under_mpirun(mpi_jobs):
    # the example with --epochs 2 --fp16-allreduce and RINGPIPE_TIMELINE=<its folder>/timeline.json:
    # like HOROVOD_TIMELINE, shutdown() writes every rank's communication
    out = mpi_jobs.run("example")
    timeline = out.folder / "timeline.json"
    assert "(ranks: 2)" in out.stdout and len(_accuracies(out.stdout)) == 2
    spans = [e for e in json.loads(timeline.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and any(e["name"] == "allreduce" for e in spans)
    assert (out.folder / "timeline.events.json").exists()


@pytest.mark.cuda
@pytest.mark.timeout(180)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_example_runs_on_gpus_with_nccl(capfd):
    """On a GPU host the example pins each rank to its GPU and trains there, over NCCL."""
    n = min(2, torch.cuda.device_count())
    # The learning rate of two ranks (the example scales --lr by the world size) on however many GPUs.
    argv = ["--epochs", "3", "--lr", str(0.06 / n)]
    assert spawn(_run_example, n, backend="nccl", args=(argv,)) == [f"cuda:{r}" for r in range(n)]
    out = capfd.readouterr().out
    acc = _accuracies(out)
    assert len(acc) == 3 and acc[-1] > 50.0, out[-2000:]
    assert f"(ranks: {n})" in out
