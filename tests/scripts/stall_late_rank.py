"""A late rank under any launcher: the others wait for it and their stall warnings must name it.

Run with ``RINGPIPE_STALL_CHECK_SECONDS=1`` (and ``RINGPIPE_BACKEND``); each rank prints ``stall-reports <rank> <json list>``.
"""

from __future__ import annotations

import json
import os
import time

import torch

from ringpipe.comm import init_world, shutdown_world
from ringpipe.comm.rendezvous import stall_inspector

comm = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
if comm.rank == comm.size - 1:
    time.sleep(3.0)  # the last rank computes while the others already wait in the allreduce
comm.allreduce(torch.ones(1024))
inspector = stall_inspector()
print(f"stall-reports {comm.rank} {json.dumps(list(inspector.reports) if inspector else None)}", flush=True)
shutdown_world()
