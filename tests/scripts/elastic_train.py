"""An elastic Horovod training program for the elastic driver's end-to-end tests (PyTorch).

``elastic_train.py OUT_DIR SCENARIO``: full-batch gradient descent with momentum on 12 rows
(every world size computes the same step: each rank's loss is its rows' share of the global
mean), a commit after every step, under ``@hvd.elastic.run``. The scenarios (failures, hosts
added and removed) are ``elastic_scenarios.py``'s, shared with ``elastic_train_tf.py``.

Every rank prints ``step S rank R size N host H ... state D`` before each step, D a digest of the
bytes of its parameters and optimizer state (the momentum buffers); rank 0 saves the final
parameters to ``OUT_DIR/final.pt``.
"""

import hashlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_scenarios import act  # noqa: E402 (beside this file)

import ringpipe as hvd  # noqa: E402

out_dir, scenario = sys.argv[1], sys.argv[2]
STEPS = int(os.environ.get("ELASTIC_STEPS", "20"))
PAUSE = float(os.environ.get("ELASTIC_PAUSE", "0.15"))

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(1)
X = torch.randn(12, 4, generator=g)
y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
host = os.environ["HOROVOD_HOSTNAME"]
resets = []


def digest():
    """The state's bytes: parameters, then every tensor of the optimizer's state, in a fixed order."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().numpy().tobytes())
    for slot in optimizer.state_dict()["state"].values():
        for key in sorted(slot):
            if torch.is_tensor(slot[key]):
                h.update(slot[key].detach().numpy().tobytes())
    return h.hexdigest()[:16]


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        rank, size = hvd.rank(), hvd.size()
        print(f"step {state.step} rank {rank} size {size} host {host} env_rank {os.environ['HOROVOD_RANK']} "
              f"state {digest()}", flush=True)
        act(hvd, scenario, out_dir, state.step, state)
        optimizer.zero_grad()
        rows = torch.arange(12)[rank::size]
        loss = ((model(X[rows]) - y[rows]) ** 2).sum() / 12 * size
        loss.backward()
        optimizer.step()
        state.step += 1
        time.sleep(PAUSE)
        state.commit()


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
train(state)
print(f"done rank {hvd.rank()} size {hvd.size()} host {host} resets {resets}", flush=True)
if hvd.rank() == 0:
    torch.save({"weight": model.weight.detach(), "bias": model.bias.detach(), "step": state.step},
               os.path.join(out_dir, "final.pt"))
