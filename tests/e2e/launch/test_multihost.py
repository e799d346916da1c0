"""Two network-namespace hosts, `ringpipe launch --nnodes 2` on each: node ranks and a cross-node allreduce."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import netns

SCRIPT = str(Path(__file__).resolve().parents[2] / "scripts" / "multinode.py")
LATE_RANK = str(Path(__file__).resolve().parents[2] / "scripts" / "stall_late_rank.py")
REASON = netns.can_create()


def _env(**extra: str) -> dict[str, str]:
    """This environment without the rendezvous settings of another job, one thread per rank, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "RINGPIPE_BACKEND")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.netns
@pytest.mark.timeout(150)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_two_hosts_launch():
    env = _env()
    with netns.two_hosts() as (a, b):
        procs = []
        for node, host in enumerate((a, b)):
            cmd = [*host.prefix(), sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", "--nnodes", "2",
                   "--node-rank", str(node), "--rdzv-endpoint", f"{a.addr}:29631", SCRIPT]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    text = outs[0][0] + outs[1][0]
    assert text.count("multinode ok") == 4
    for rank in range(4):
        node = rank // 2
        host = "rp-host-a" if node == 0 else "rp-host-b"
        line = f"rank={rank} node={node} nodes=2 local={rank % 2}/2 host={host} sum=10 node_size=2"
        assert line in text, text
    assert text.count("leader=True") == 2



@pytest.mark.netns
@pytest.mark.mpi
@pytest.mark.timeout(150)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_two_hosts_mpirun_mpi_backend(tmp_path):
    """Open MPI across the two hosts (an rsh agent enters each namespace): the MPI communicator's world."""
    pytest.importorskip("mpi4py")
    env = _env(RINGPIPE_BACKEND="mpi")
    with netns.two_hosts() as hosts:
        cmd, extra = netns.mpirun_across(hosts, [sys.executable, SCRIPT], tmp_path / "hostfile", slots=2)
        out = subprocess.run(cmd, capture_output=True, text=True, env={**env, **extra}, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count("multinode ok") == 4, out.stdout
    for rank in range(4):
        node = rank // 2
        host = "rp-host-a" if node == 0 else "rp-host-b"
        line = f"rank={rank} node={node} nodes=2 local={rank % 2}/2 host={host} sum=10 node_size=2"
        assert line in out.stdout, out.stdout


@pytest.mark.netns
@pytest.mark.mpi
@pytest.mark.timeout(150)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_two_hosts_mpi_stall_inspector_reaches_rank0_store(tmp_path):
    """Under MPI across hosts the inspector's store is served by rank 0 on a non-loopback address."""
    pytest.importorskip("mpi4py")
    from ranks.comm.test_stall import assert_late_rank_named, late_rank_reports

    env = _env(RINGPIPE_BACKEND="mpi", RINGPIPE_STALL_CHECK_SECONDS="1")
    with netns.two_hosts() as hosts:
        cmd, extra = netns.mpirun_across(hosts, [sys.executable, LATE_RANK], tmp_path / "hostfile", slots=2)
        out = subprocess.run(cmd, capture_output=True, text=True, env={**env, **extra}, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "cannot reach the job's key-value store" not in out.stderr, out.stderr[-3000:]
    assert_late_rank_named(late_rank_reports(out.stdout, 4), 4)
