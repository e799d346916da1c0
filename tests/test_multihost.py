"""Two network-namespace hosts, `ringpipe launch --nnodes 2` on each: node ranks and a cross-node allreduce."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import netns

SCRIPT = str(Path(__file__).parent / "scripts" / "multinode.py")
REASON = netns.can_create()


@pytest.mark.netns
@pytest.mark.timeout(150)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_two_hosts_launch():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "RINGPIPE_BACKEND"):
        env.pop(k, None)
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
