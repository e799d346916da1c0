"""Clock offsets between hosts: ``doctor_clock.py [REPS]``.

Every rank calls ``clock_offsets`` (the first step of every ``collect_events``) REPS times;
rank 0 prints ``CLOCK {"ms": [...], "offsets_ns": [...]}``: the slowest rank's milliseconds per
call and the last call's offsets.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ringpipe.comm import init_world, shutdown_world
from ringpipe.observe.collect import clock_offsets

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
comm = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
comm.barrier()
mine, offsets = [], []
for _ in range(reps):
    t0 = time.perf_counter()
    offsets = clock_offsets(comm)
    mine.append(1e3 * (time.perf_counter() - t0))
every = comm.allgather_object((mine, offsets))
if comm.rank == 0:
    agreed = all(o == offsets for _, o in every)
    print("CLOCK " + json.dumps({"ms": [max(m[i] for m, _ in every) for i in range(reps)], "offsets_ns": offsets,
                                 "agreed": agreed}), flush=True)
shutdown_world()
