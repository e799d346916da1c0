"""A Horovod training program, run unchanged under Horovod and under ringpipe (``import ringpipe as hvd``).

    horovodrun -np 2 --gloo python benchmarks/lib/horovod_program.py --impl horovod --model mlp
    ringpipe launch -n 2 python benchmarks/lib/horovod_program.py --impl ringpipe --model mlp

The only line that differs between the two is the import (``import horovod.torch as hvd`` or
``import ringpipe as hvd``); everything after it is Horovod's documented usage: ``hvd.init()``,
the learning rate scaled by ``hvd.size()``, ``broadcast_parameters`` and
``broadcast_optimizer_state`` from rank 0, ``hvd.DistributedOptimizer`` with
``named_parameters``, then training steps (SGD with momentum on one fixed batch of
``lib.models``). After ``--warmup`` steps, ``--steps`` steps are timed one by one; the per-step
times of all ranks are reduced with ``hvd.Max`` (the slowest rank sets a step's time), and rank 0
prints one row (:func:`lib.procs.emit`): the implementation, the median step and every step,
the final loss and a checksum of the parameters (the same under both implementations up to
rounding, since both average the same gradients).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lib import procs  # noqa: E402
from lib.models import loss, make_model  # noqa: E402

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("horovod", "ringpipe"), required=True)
    p.add_argument("--model", default="mlp")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    if args.impl == "horovod":
        import horovod
        import horovod.torch as hvd

        version = horovod.__version__
    else:
        import ringpipe as hvd

        version = hvd.__version__

    torch.set_num_threads(1)
    hvd.init()
    model, x, y = make_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        out = loss(model(x), y)
        out.backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name="step_times").tolist()
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    if hvd.rank() == 0:
        procs.emit({"impl": args.impl, "model": args.model, "size": hvd.size(), "median_s": statistics.median(slowest),
                    "steps_s": slowest, "loss": float(out), "checksum": checksum,
                    "version": version})
    return 0


if __name__ == "__main__":
    sys.exit(main())
