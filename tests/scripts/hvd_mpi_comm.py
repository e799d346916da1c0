"""Rank script: ``init(comm=<mpi4py communicator>)`` as Horovod documents it (docs/mpi.rst, mpi4py).

MPI.COMM_WORLD is split into even and odd world ranks; each part initialises ringpipe on its own
communicator and reports what the Horovod API sees; then the whole world initialises on
``MPI.COMM_WORLD`` with a process set given by an mpi4py communicator. Writes rank<W>.json.
"""

import json
import os
import sys

import torch
from mpi4py import MPI

import ringpipe as hvd

world = MPI.COMM_WORLD
part = world.Split(color=world.rank % 2, key=world.rank)
hvd.init(comm=part)
out = {
    "rank": hvd.rank(), "size": hvd.size(),
    "local": [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
    "sum": hvd.allreduce(torch.tensor([float(world.rank)]), op=hvd.Sum).tolist(),
    "gather": hvd.allgather_object(world.rank),
    "bcast": hvd.broadcast_object(world.rank, root_rank=0),
}
hvd.shutdown()
hvd.init(comm=world, process_sets=[hvd.ProcessSet(part)])
out["again"] = [hvd.rank(), hvd.size(), hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).tolist()]
out["sets"] = sorted(hvd.mpi_ops._basics._get_process_set_ids_and_ranks().values())
hvd.shutdown()
try:
    hvd.init(comm=part, backend="gloo")
except ValueError as exc:
    out["gloo"] = str(exc)
with open(os.path.join(sys.argv[1], f"rank{world.rank}.json"), "w") as f:
    json.dump(out, f)
