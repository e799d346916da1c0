"""A plain torch.distributed + DDP script (no ringpipe import): must run unchanged under ringpipe launch."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.full((2, 4), float(dist.get_rank() + 1))
model(x).sum().backward()
opt.step()
w = model.module.weight.detach().clone()
ws = [torch.empty_like(w) for _ in range(dist.get_world_size())]
dist.all_gather(ws, w)
assert all(torch.equal(ws[0], x) for x in ws), "replicas diverged"
print(f"plain-ddp ok rank={dist.get_rank()} world={dist.get_world_size()}", flush=True)
# Both ranks reach the teardown together, then leave without interpreter finalization. DDP's
# reducer keeps the gloo group (and its worker threads) alive past destroy_process_group, and a
# worker that drops its last reference to a finished work after finalization has begun must
# take the GIL to release the Python state that work captured: the thread is killed and the
# process aborts ("terminate called without an active exception"), about one run in ten on a
# busy 2-core machine. Exiting with os._exit after flushing is the usual way around it.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
