"""Two-node check: node rank, node count, hostnames and an allreduce across the nodes."""

import os
import socket

import torch

import ringpipe as rp

comm = rp.init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
topo = comm.topology
t = torch.tensor([float(comm.rank + 1)])
comm.allreduce(t)
node = comm.node_comm()
leaders = comm.leaders_comm()
print(
    f"multinode ok rank={topo.rank} node={topo.node_rank} nodes={topo.num_nodes} local={topo.local_rank}/"
    f"{topo.local_size} host={socket.gethostname()} sum={t.item():g} node_size={node.size} "
    f"leader={leaders is not None}",
    flush=True,
)
rp.shutdown_world()
