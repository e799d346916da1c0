"""A script that never shuts its world down: at exit the process group must already be destroyed.

The check runs in an ``atexit`` handler registered before ``init_world``; handlers run last
registered first, so it sees the state after ringpipe's own exit handler.
"""

from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist


def report() -> None:
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    print(f"at-exit rank={os.environ.get('RANK')} group_alive={dist.is_initialized()} threads={threads}",
          flush=True)


atexit.register(report)

import ringpipe as rp  # noqa: E402 - after the handler, so that it runs after ringpipe's

comm = rp.init_world("gloo")
t = torch.ones(4)
comm.allreduce(t)
assert t.tolist() == [float(comm.size)] * 4
