"""A plain torch.distributed + DDP script (no ringpipe import): must run unchanged under ringpipe launch."""

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
# Both ranks reach the teardown together: gloo can abort a rank whose peer closed its connections
# while its own threads were still reading ("terminate called without an active exception").
dist.barrier()
dist.destroy_process_group()
