"""A late rank in a user's own script: ``doctor_late_rank.py OUT LATE_RANK [BYTES] [REPS]``.

Every rank runs ring allreduces; rank LATE_RANK sleeps 30-50 ms before each (more work between
collectives). Rank 0 saves every rank's events to OUT for ``ringpipe doctor OUT``.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

from ringpipe import collectives
from ringpipe.comm import init_world, shutdown_world
from ringpipe.observe import collect_events, save_events

out, late = sys.argv[1], int(sys.argv[2])
nbytes = int(sys.argv[3]) if len(sys.argv) > 3 else 256 << 10
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
comm = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
rnd = random.Random(comm.rank)
x = torch.ones(nbytes // 4)
for _ in range(reps):
    if comm.rank == late:
        time.sleep(rnd.uniform(0.03, 0.05))
    collectives.allreduce(comm, x, "sum", algorithm="ring")
job = collect_events(comm)
if job is not None:
    save_events(out, job)
    print(f"late-rank events saved {out}", flush=True)
shutdown_world()
