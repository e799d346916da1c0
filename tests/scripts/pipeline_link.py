"""A 1F1B pipeline of an MLP, one stage per rank, its events saved for the pipeline doctor.

    pipeline_link.py OUT [--trials N] [--steps S] [--width W] [--microbatches M] [--batch B] [--schedule async]

Every rank holds 2 blocks of ``Linear(W, W) + ReLU`` (the last stage also a small head), trains
``S`` steps on a batch of ``B`` in ``M`` micro-batches (gloo, one intra-op thread), with its
actions recorded; with ``--schedule async`` the asynchronous pipeline (``async_1f1b``) instead
takes the ``S`` batches as one stream (``stream_step`` each, then ``drain``: an optimizer step
per micro-batch, as ``ringpipe train --mode async`` runs an epoch) (:mod:`ringpipe.pipeline.action_events`); rank 0 saves every rank's events of
trial ``t`` to ``OUT`` (one trial) or ``OUT.t.json`` for ``ringpipe doctor`` and prints
``pipeline events saved PATH``. Each trial starts a fresh trainer and a cleared event log. The
messages between stages are ``B / M * W * 4`` bytes each way per micro-batch.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from ringpipe.comm import init_world, shutdown_world
from ringpipe.observe import collect_events, save_events
from ringpipe.pipeline import PipelineTrainer
from ringpipe.pipeline.action_events import record_actions

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--trials", type=int, default=1)
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--width", type=int, default=1024)
ap.add_argument("--microbatches", type=int, default=6)
ap.add_argument("--batch", type=int, default=192)
ap.add_argument("--schedule", choices=("1f1b", "async"), default="1f1b")
args = ap.parse_args()
torch.set_num_threads(1)
comm = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
p = comm.size
balance = [2] * (p - 1) + [3]
for trial in range(args.trials):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(sum(balance) - 1)]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10))
    comm.barrier()
    comm.log.clear()
    t = PipelineTrainer(comm, model, balance=balance, schedule="async_1f1b" if args.schedule == "async" else "1f1b", microbatches=args.microbatches,
                        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01),
                        loss_fn=nn.functional.cross_entropy)
    record_actions(comm.log, t.runtimes, t.executor, schedule=t.schedule, stage=t.stage, stages=t.num_stages,
                   microbatches=args.microbatches, chunks=t.chunks, balance=list(t.balance), recompute=False,
                   step_every=1)
    g = torch.Generator().manual_seed(trial)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    for _ in range(args.steps):
        if t.is_async:
            t.stream_step(x if t.is_first else None, y if t.is_last else None)
        else:
            t.train_step(x if t.is_first else None, y if t.is_last else None)
    t.drain()
    job = collect_events(comm, comm.log)
    if job is not None:
        path = args.out if args.trials == 1 else f"{args.out}.{trial}.json"
        save_events(path, job)
        print(f"pipeline events saved {path}", flush=True)
shutdown_world()
