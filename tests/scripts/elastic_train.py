"""An elastic Horovod training program for the elastic driver's end-to-end tests.

``elastic_train.py OUT_DIR SCENARIO``: full-batch gradient descent with momentum on 12 rows
(every world size computes the same step: each rank's loss is its rows' share of the global
mean), a commit after every step, under ``@hvd.elastic.run``. The scenario acts at a step:

* ``grow_shrink``: rank 0 rewrites the hosts file (``OUT_DIR/hosts``, which the discovery script
  prints) to four hosts at step 2, then, once the world has 4 ranks, to the last two only (the
  hosts of ranks 0 and 1 go);
* ``two_failures``: the worker on 127.0.0.2 raises at step 3, the one on 127.0.0.3 is SIGKILLed
  at step 6;
* ``kill_one``: the worker on 127.0.0.2 is SIGKILLed at step 3;
* ``cooldown``: the worker on 127.0.0.2 raises at step 3; the survivor waits for the host to come
  back from the blacklist;
* ``all_fail``: every worker raises at step 3;
* ``fail_each``: the worker on 127.0.0.1 raises at step 2, then the one on 127.0.0.2 at step 4;
* ``ssh_hosts``: two hosts named by ``ELASTIC_HOSTS`` (``A B``, reached over ssh); the job starts on
  A alone. Rank 0 adds B at step 2 (1 -> 2 workers), removes it at step 5 (2 -> 1), adds it again
  at step 8 (1 -> 2), and B's worker is SIGKILLed at step 11: B is lost and the job ends on A.

Each failure happens once (a marker file in OUT_DIR). Every rank prints ``step S rank R size N
host H`` before each step; rank 0 saves the final parameters to ``OUT_DIR/final.pt``.
"""

import os
import signal
import sys
import time

import torch

import ringpipe as hvd

out_dir, scenario = sys.argv[1], sys.argv[2]
STEPS = int(os.environ.get("ELASTIC_STEPS", "20"))
PAUSE = float(os.environ.get("ELASTIC_PAUSE", "0.15"))


def once(name):
    try:
        os.close(os.open(os.path.join(out_dir, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def write_hosts(lines):
    tmp = os.path.join(out_dir, "hosts.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, os.path.join(out_dir, "hosts"))


hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(1)
X = torch.randn(12, 4, generator=g)
y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
host = os.environ["HOROVOD_HOSTNAME"]
HOSTS = os.environ.get("ELASTIC_HOSTS", "").split()
resets = []


def hold(state):
    """Every rank: wait at this step for the driver's next world (HostsUpdatedInterrupt), 60 s at most."""
    for _ in range(300):
        time.sleep(0.2)
        state.check_host_updates()


def act(step, state):
    rank, size = hvd.rank(), hvd.size()
    if scenario == "grow_shrink":
        if size == 2 and step == 2:
            if rank == 0 and once("grow"):
                write_hosts(["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"])
            hold(state)  # until the new workers joined
        elif size == 4:
            if rank == 0 and once("shrink"):
                write_hosts(["127.0.0.3:1", "127.0.0.4:1"])
            hold(state)  # until the hosts of ranks 0 and 1 are gone
    elif scenario == "two_failures":
        if step == 3 and host == "127.0.0.2" and once("fail-exc"):
            raise ValueError("injected failure on 127.0.0.2")
        if step == 6 and host == "127.0.0.3" and once("fail-kill"):
            os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "cooldown":
        if step == 3 and host == "127.0.0.2" and once("fail-exc"):
            raise ValueError("injected failure on 127.0.0.2")
        if step >= 3 and size == 1:
            hold(state)  # until 127.0.0.2's cooldown ends and its new worker joins
    elif scenario == "kill_one":
        if step == 3 and host == "127.0.0.2" and once("fail-kill"):
            os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "all_fail":
        if step == 3:
            raise ValueError(f"injected failure on {host}")
    elif scenario == "fail_each":
        if step == 2 and host == "127.0.0.1" and once("fail-1"):
            raise ValueError("injected failure on 127.0.0.1")
        if step == 4 and host == "127.0.0.2" and once("fail-2"):
            raise ValueError("injected failure on 127.0.0.2")
    elif scenario == "ssh_hosts":
        a, b = HOSTS
        if size == 1 and step in (2, 8):
            if rank == 0 and once(f"add-{step}"):
                write_hosts([f"{a}:1", f"{b}:1"])
            hold(state)  # until B's new worker joined
        elif size == 2 and step == 5:
            if rank == 0 and once("remove"):
                write_hosts([f"{a}:1"])
            hold(state)  # until B's worker left
        elif size == 2 and step == 11 and host == b and once("lose"):
            os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        rank, size = hvd.rank(), hvd.size()
        print(f"step {state.step} rank {rank} size {size} host {host} env_rank {os.environ['HOROVOD_RANK']}",
              flush=True)
        act(state.step, state)
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
