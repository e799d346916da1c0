"""A job whose rank 1 dies (exit code 3, or SIGKILL with DIE_SIGNAL=1) while the others wait."""

import os
import signal
import sys
import time

import ringpipe as rp

comm = rp.init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
print(f"started rank {comm.rank}", flush=True)
if comm.rank == 1:
    time.sleep(0.5)
    if os.environ.get("DIE_SIGNAL"):
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
comm.barrier()  # never completes: rank 1 is gone
time.sleep(120)
