"""Communicators with real processes: every operation against a local reference, gloo and MPI."""

import shutil
from pathlib import Path

import pytest
import torch

from ringpipe.comm import CommError, comm_stats, default_log, init_world
from ringpipe.launch import spawn
from scripts.comm_checks import check_all

HERE = Path(__file__).resolve().parents[2]  # tests/: the helper scripts and modules
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_gloo_every_operation(worlds, nprocs):
    counts = worlds.spawn(check_all, nprocs)
    assert all(c > 200 for c in counts)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
@pytest.mark.parametrize("nprocs", [2, 3])
def test_mpi_every_operation(mpi_jobs, nprocs):
    out = mpi_jobs.run(f"comm-{nprocs}")  # scripts/comm_checks.py with RINGPIPE_BACKEND=mpi
    assert out.stdout.count("comm-checks ok") == nprocs
    assert "launcher=openmpi" in out.stdout


def _events(comm):
    default_log().clear()
    t = torch.ones(256)
    comm.allreduce(t)
    other = 1 - comm.rank
    if comm.rank == 0:
        comm.send(t, other, tag=9)
    else:
        comm.recv(t, other, tag=9)
    evs = default_log().events()
    return [(e.op, e.nbytes, e.peer, e.tag, e.end_ns >= e.start_ns) for e in evs], comm_stats()


def test_events_recorded_at_the_choke_point(worlds):
    (ev0, stats0), (ev1, _) = worlds.spawn(_events, 2)
    assert ("allreduce", 1024, -1, 0, True) in ev0
    assert ("send", 1024, 1, 9, True) in ev0
    assert ("recv", 1024, 0, 9, True) in ev1
    assert stats0["allreduce"]["calls"] == 1 and stats0["allreduce"]["bytes"] == 1024


def test_single_process_world():
    comm = init_world("gloo")
    try:
        t = torch.arange(3.0)
        assert torch.equal(comm.allreduce(t, "average"), torch.arange(3.0))
        assert comm.size == 1 and comm.topology.num_nodes == 1
        assert comm.allgather_object("x") == ["x"]
    finally:
        from ringpipe.comm import shutdown_world

        shutdown_world()


def test_bad_backends_are_named():
    with pytest.raises(CommError, match="valid backends: gloo, nccl, mpi"):
        init_world("tcp")
    if not torch.cuda.is_available():
        with pytest.raises(CommError, match="needs CUDA"):
            init_world("nccl")


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="a host without GPUs")
def test_default_backend_without_gpus_is_gloo(monkeypatch):
    from ringpipe.comm.rendezvous import default_backend, resolve_backend

    monkeypatch.delenv("RINGPIPE_BACKEND", raising=False)
    assert default_backend() == default_backend(8) == "gloo"
    assert resolve_backend(None, 2) == "gloo" and resolve_backend("NCCL", 2) == "nccl"  # asked for: kept


def _wrong_device(comm):
    try:
        comm.allreduce(torch.ones(2, device="meta"))
    except CommError as exc:
        return str(exc)
    return "accepted"


def test_wrong_device_is_refused(worlds):
    msgs = worlds.spawn(_wrong_device, 2)
    assert all("cannot send tensors on meta" in m for m in msgs)


def _nccl_cpu_and_cuda(comm):
    cpu = torch.full((3,), float(comm.rank + 1))
    comm.allreduce(cpu, "sum")
    gpu = torch.full((3,), float(comm.rank + 1), device=comm.device)
    comm.allreduce(gpu, "average")
    got = comm.allgather(torch.tensor([comm.rank]))
    return cpu.device.type, cpu.tolist(), gpu.device.type, gpu.cpu().tolist(), [g.device.type for g in got]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_world_moves_cpu_tensors_over_gloo_as_horovod():
    """Horovod reduces a CPU tensor in a GPU job (its CPU operations); under NCCL so does ringpipe."""
    n = min(2, torch.cuda.device_count())
    total = float(sum(range(1, n + 1)))
    for cpu_dev, cpu, gpu_dev, gpu, gathered in spawn(_nccl_cpu_and_cuda, n, backend="nccl"):
        assert (cpu_dev, cpu) == ("cpu", [total] * 3)
        assert (gpu_dev, gpu) == ("cuda", [total / n] * 3)
        assert gathered == ["cpu"] * n
