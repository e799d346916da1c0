"""Pipelines over the MPI backend (mpi4py, 2 ranks under ``mpirun``) against one process.

The synchronous schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2) must end with the weights
of one process that accumulates the same micro-batches' gradients and takes torch's SGD step;
the asynchronous 1F1B stream (``step_every`` 1 and 2) must end with the weights of the
hand-written reference of ``tests/unit/pipeline/test_pipeline_reference.py``. Run as a script, this file is
what each rank runs under ``mpirun``: it trains every configuration over ``init_world("mpi")``
and rank 0 saves the final weights for the test to check.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest
import torch
from torch import nn

from ranks.pipeline.test_pipeline_async import (
    BALANCE,
    MICRO,
    OPTS,
    expected,
    initial,
    make_data,
    make_layers,
    optimizer_factory,
)
from ringpipe.pipeline import PipelineTrainer

HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
ATOL = 1e-10

#: schedule -> (balance over the 7 layers, extra PipelineTrainer options)
SYNC = {
    "gpipe": (BALANCE[2], {}),
    "1f1b": (BALANCE[2], {}),
    "zb_h1": (BALANCE[2], {}),
    "zb_h2": (BALANCE[2], {}),
    "interleaved_1f1b": ([2, 2, 2, 1], {"chunks": 2}),  # two chunks a rank, ranks 0, 1, 0, 1
}
ASYNC_STEP_EVERY = (1, 2)


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    keys = nn.Sequential(*make_layers()).state_dict()  # W, b of each layer, in the model's order
    return torch.cat([state[k].flatten() for k in keys])


def train_all(comm) -> dict[str, torch.Tensor]:
    """Every configuration on this rank; the full model's final weights, flattened (on every rank)."""
    opt = OPTS["sgd"]
    out = {}
    runs = [(s, bal, extra, 1) for s, (bal, extra) in SYNC.items()]
    runs += [("async", BALANCE[2], {}, k) for k in ASYNC_STEP_EVERY]
    for sched, bal, extra, k in runs:
        t = PipelineTrainer(
            comm, make_layers(), balance=bal, schedule=sched, microbatches=MICRO,
            optimizer_factory=optimizer_factory(opt), loss_fn=nn.functional.mse_loss, step_every=k, **extra,
        )
        batches = [(x if t.is_first else None, y if t.is_last else None) for x, y in make_data()]
        if sched == "async":
            t.train_stream(batches, len(batches))
        else:
            for x, y in batches:
                t.train_step(x, y)
        out[f"{sched}/{k}"] = flat(t.model_state_dict())
    return out


def one_process() -> torch.Tensor:
    """The synchronous reference: one model, each micro-batch's loss scaled by its share of the batch,
    gradients accumulated over the batch, then torch's SGD step."""
    model = nn.Sequential(*make_layers())
    o = OPTS["sgd"]
    sgd = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    for x, y in make_data():
        for xm, ym in zip(x.tensor_split(MICRO), y.tensor_split(MICRO), strict=True):
            (nn.functional.mse_loss(model(xm), ym) * len(ym) / len(y)).backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)
    return torch.cat([v.detach().flatten() for v in model.state_dict().values()])


@pytest.fixture(scope="module")
def mpi_results(mpi_jobs):
    if not HAVE_MPI:
        pytest.skip("needs mpirun and mpi4py")
    # this file as a script on 2 ranks (RINGPIPE_BACKEND=mpi), in the 2-rank job of tests/mpi_ranks.py
    run = mpi_jobs.run("pipeline")
    assert run.stdout.count("pipeline-mpi ok backend=mpi") == 2, run.stdout[-4000:]
    return torch.load(run.folder / "weights.pt")


@pytest.mark.mpi
@pytest.mark.timeout(600)  # 2 ranks under mpirun import torch on a loaded machine
@pytest.mark.parametrize("schedule", list(SYNC))
def test_sync_schedules_over_mpi_train_as_one_process(mpi_results, schedule):
    got, want = mpi_results[f"{schedule}/1"], one_process()
    assert float((want - initial()).abs().max()) > 1e-3  # the weights moved
    assert torch.allclose(got, want, rtol=0, atol=ATOL), float((got - want).abs().max())


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("step_every", ASYNC_STEP_EVERY)
def test_async_stream_over_mpi_matches_the_reference(mpi_results, step_every):
    got, want = mpi_results[f"async/{step_every}"], expected(2, "stale", OPTS["sgd"], step_every, False)
    assert float((want - initial()).abs().max()) > 1e-3
    assert torch.allclose(got, want, rtol=0, atol=ATOL), float((got - want).abs().max())
    # with staleness the stream is not the synchronous run (the flush matters)
    assert float((got - one_process()).abs().max()) > 1e-6


if __name__ == "__main__":  # each rank under mpirun
    from ringpipe.comm import init_world, shutdown_world

    world = init_world("mpi")
    assert world.backend == "mpi", world.backend
    results = train_all(world)
    if world.rank == 0:
        torch.save(results, sys.argv[1])
    world.barrier()
    print(f"pipeline-mpi ok backend={world.backend} rank={world.rank}", flush=True)
    shutdown_world()
