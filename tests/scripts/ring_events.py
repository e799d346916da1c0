"""Run ring allreduces under any launcher and save every rank's events: ``ring_events.py OUT [BYTES] [REPS]``.

Rank 0 writes the events file that ``ringpipe doctor OUT`` reads.
"""

from __future__ import annotations

import os
import sys

import torch

from ringpipe import collectives
from ringpipe.comm import init_world, shutdown_world
from ringpipe.observe import collect_events, save_events

out = sys.argv[1]
nbytes = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
comm = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
x = torch.ones(nbytes // 4)
for _ in range(reps):
    collectives.allreduce(comm, x, "sum", algorithm="ring")
job = collect_events(comm)
if job is not None:
    save_events(out, job)
    print(f"ring-events saved {out}", flush=True)
shutdown_world()
