"""The elastic program ``elastic_recovery.py`` runs under the elastic driver: timed steps and one membership event.

``elastic_program.py OUT_DIR EVENT``: a small MLP trained under ``@hvd.elastic.run`` with a commit
after every step; every rank appends ``<unix time> <step> <rank> <size> <host>`` to
``OUT_DIR/steps.<host>`` after each completed step. At step 5 (once):

* ``death``: the worker of the last discovered host writes the time to ``OUT_DIR/event`` and
  SIGKILLs itself;
* ``join``: rank 0 adds the host named in ``OUT_DIR/new_host`` to ``OUT_DIR/hosts`` (which the
  discovery script prints) and writes the time to ``OUT_DIR/event``; every rank then waits at that
  step (``check_host_updates``) until the world has ``ELASTIC_WORKERS`` ranks.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

import ringpipe as hvd

out_dir, event = sys.argv[1], sys.argv[2]
STEPS = int(os.environ.get("ELASTIC_STEPS", "40"))
PAUSE = float(os.environ.get("ELASTIC_PAUSE", "0.05"))
TARGET = int(os.environ.get("ELASTIC_WORKERS", "0"))  # the workers after the event


def once(name):
    try:
        os.close(os.open(os.path.join(out_dir, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def stamp(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=model.named_parameters())
x, y = torch.randn(64, 32), torch.randn(64, 1)
host = os.environ["HOROVOD_HOSTNAME"]
hosts = Path(out_dir, "hosts").read_text().split()
log = open(os.path.join(out_dir, f"steps.{host}"), "a", buffering=1)  # noqa: SIM115 - open for the process's life


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        if state.step == 5 and event == "death" and host == hosts[-1].split(":")[0] and once("died"):
            stamp(os.path.join(out_dir, "event"), f"{time.time()}")
            os.kill(os.getpid(), signal.SIGKILL)
        if state.step == 5 and event == "join" and hvd.rank() == 0 and once("joined"):
            new = Path(out_dir, "new_host").read_text().strip()
            stamp(os.path.join(out_dir, "hosts"), "\n".join([*hosts, new]) + "\n")
            stamp(os.path.join(out_dir, "event"), f"{time.time()}")
        if state.step == 5 and event == "join" and hvd.size() < TARGET:
            for _ in range(600):  # every rank: wait here for the new worker (the driver's next world)
                time.sleep(0.05)
                state.check_host_updates()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        state.step += 1
        log.write(f"{time.time()} {state.step} {hvd.rank()} {hvd.size()} {host}\n")
        time.sleep(PAUSE)
        state.commit()


train(hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0))
