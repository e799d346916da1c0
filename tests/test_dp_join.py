"""join with uneven shards: learning-rate schedules on the served steps, other collectives while a rank is joined."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ringpipe.dp import DistributedOptimizer, join
from ringpipe.launch import mpirun_command, spawn

HERE = Path(__file__).parent
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None
LR, GAMMA = 0.1, 0.5


def _np(t: torch.Tensor):
    return t.detach().clone().numpy()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches():
    g = torch.Generator().manual_seed(5)
    return torch.randn(12, 4, 6, generator=g), torch.randn(12, 4, 3, generator=g)


def _scheduler(kind: str, opt: torch.optim.Optimizer):
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + k))


def _mine(rank: int, batches: tuple[int, ...]) -> list[int]:
    """Rank r's batches: r, r + n, ... while it still has some (batch i of step k is k * n + r)."""
    n = len(batches)
    return [k * n + rank for k in range(batches[rank])]


def _uneven_with_schedule(comm, batches, kind):
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                               model.named_parameters(), bucket_bytes=100, comm=comm)
    sched = _scheduler(kind, opt)
    xs, ys = _batches()
    for i in _mine(comm.rank, batches):
        opt.zero_grad()
        nn.functional.mse_loss(model(xs[i]), ys[i]).backward()
        opt.step()
        sched.step()
    last = join(comm)
    return last, [_np(p) for p in model.parameters()], opt.param_groups[0]["lr"]


def _schedule_reference(batches, kind):
    """One process: step k averages the losses of the ranks that still had data at step k."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = _scheduler(kind, opt)
    xs, ys = _batches()
    n = len(batches)
    for k in range(max(batches)):
        opt.zero_grad()
        idx = [k * n + r for r in range(n) if batches[r] > k]
        torch.stack([nn.functional.mse_loss(model(xs[i]), ys[i]) for i in idx]).mean().backward()
        opt.step()
        sched.step()
    return [p.detach() for p in model.parameters()], opt.param_groups[0]["lr"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("batches", "kind"), [((3, 1), "step"), ((1, 2, 4), "lambda")])
def test_join_serves_steps_with_the_learning_rate_of_the_ranks_with_data(batches, kind):
    results = spawn(_uneven_with_schedule, len(batches), args=(batches, kind))
    ref, ref_lr = _schedule_reference(batches, kind)
    longest = max(range(len(batches)), key=lambda r: (batches[r], r))
    for rank, (last, params, lr) in enumerate(results):
        assert last == longest
        for got, want in zip(params, ref, strict=True):
            assert torch.allclose(torch.as_tensor(got), want, atol=1e-6), rank
        for got, first in zip(params, results[0][1], strict=True):
            assert (got == first).all(), f"rank {rank} differs from rank 0 after join"
        # every rank leaves join with the hyper-parameters of the rank that joined last
        assert lr == pytest.approx(ref_lr), rank
