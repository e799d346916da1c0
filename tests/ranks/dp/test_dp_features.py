"""Broadcasts, join with uneven shards, SyncBatchNorm, sharding, LR warmup and checkpoints (real processes)."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from ringpipe.core.errors import JoinError
from ringpipe.dp import (
    DistributedOptimizer,
    DistributedSampler,
    GradualWarmup,
    SyncBatchNorm,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
    load_checkpoint,
    save_checkpoint,
    scale_lr,
)

HERE = Path(__file__).resolve().parents[2]  # tests/: the helper scripts and modules
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None


def _np(t: torch.Tensor):
    return t.detach().clone().numpy()


# ----------------------------------------------------------------------------- broadcasts


def _broadcasts(comm, root):
    torch.manual_seed(100 + comm.rank)  # every rank starts different
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    broadcast_parameters(model.state_dict(), root_rank=root, comm=comm)
    state = {k: _np(v) for k, v in model.state_dict().items()}

    torch.manual_seed(200 + comm.rank)
    other = nn.Linear(3, 3)
    broadcast_parameters(other.named_parameters(), root_rank=root, comm=comm)

    opt = torch.optim.Adam(model.parameters(), lr=0.001 * (comm.rank + 1))
    if comm.rank == root:  # only the root has state (as after loading a checkpoint there)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
        opt.param_groups[0]["lr"] = 0.123
        opt.param_groups[0]["betas"] = (0.8, 0.9)
    broadcast_optimizer_state(opt, root_rank=root, comm=comm)
    sd = opt.state_dict()
    flat = {
        "groups": [{k: v for k, v in g.items()} for g in sd["param_groups"]],
        "state": {i: {k: _np(v) if torch.is_tensor(v) else v for k, v in s.items()} for i, s in sd["state"].items()},
    }
    return state, _np(other.weight), flat


@pytest.mark.timeout(60)
@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_parameters_and_optimizer_state(worlds, root):
    _check_broadcasts(worlds.spawn(_broadcasts, 2, args=(root,)))


def mpi_broadcasts(out_dir: str) -> None:
    """Entry point under mpirun: the broadcasts from either root with the MPI communicator."""
    from ringpipe.comm import init_world

    torch.set_num_threads(1)
    comm = init_world("mpi")
    results = [_broadcasts(comm, root) for root in (0, 1)]
    with open(os.path.join(out_dir, f"rank{comm.rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_broadcast_parameters_and_optimizer_state_on_mpi(mpi_jobs):
    out = mpi_jobs.run("dp_features")  # its mpi entry point above on 2 ranks, writing into its folder
    per_rank = [pickle.loads((out.folder / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for root in (0, 1):
        _check_broadcasts([per_rank[0][root], per_rank[1][root]])


def _check_broadcasts(results):
    (s0, w0, o0), (s1, w1, o1) = results
    for k in s0:
        assert (s0[k] == s1[k]).all(), k
    assert (w0 == w1).all()
    assert o0["groups"] == o1["groups"] and o1["groups"][0]["lr"] == 0.123
    assert o1["groups"][0]["betas"] == (0.8, 0.9)
    assert set(o0["state"]) == set(o1["state"]) and len(o0["state"]) == 6
    for i in o0["state"]:
        for k, v in o0["state"][i].items():
            assert (v == o1["state"][i][k]).all(), (i, k)
    assert float(o1["state"][0]["step"]) == 2.0


def _mismatched_broadcast(comm):
    model = nn.Linear(4, 4 + comm.rank)
    try:
        broadcast_parameters(model.state_dict(), comm=comm)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_broadcast_of_different_models_is_an_error(worlds):
    for msg in worlds.spawn(_mismatched_broadcast, 2):
        assert "rank 1 does not hold the same tensors as rank 0" in msg and "weight" in msg


# ----------------------------------------------------------------------------- join


def _uneven(comm, batches):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model.named_parameters(), bucket_bytes=100, comm=comm)
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(10, 4, 6, generator=g)
    ys = torch.randn(10, 4, 3, generator=g)
    mine = [i for i in range(sum(batches)) if _owner(i, batches) == comm.rank]
    for i in mine:
        opt.zero_grad()
        nn.functional.mse_loss(model(xs[i]), ys[i]).backward()
        opt.step()
    last = join(comm)
    # after join the optimizer keeps working (next epoch): one more equal step everywhere
    opt.zero_grad()
    nn.functional.mse_loss(model(xs[9]), ys[9]).backward()
    opt.step()
    return last, [_np(p) for p in model.parameters()]


def _owner(i, batches):
    """Batch i belongs to rank r: ranks take turns while they still have batches."""
    counts = [0] * len(batches)
    order = []
    while len(order) < sum(batches):
        for r in range(len(batches)):
            if counts[r] < batches[r]:
                order.append(r)
                counts[r] += 1
    return order[i]


def _uneven_reference(batches):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(10, 4, 6, generator=g)
    ys = torch.randn(10, 4, 3, generator=g)
    steps: dict[int, list[int]] = {}
    seen = [0] * len(batches)
    for i in range(sum(batches)):
        r = _owner(i, batches)
        steps.setdefault(seen[r], []).append(i)
        seen[r] += 1
    n = len(batches)
    for k in sorted(steps):  # Horovod's Average with joined ranks: the ranks with data, divided by n
        opt.zero_grad()
        (torch.stack([nn.functional.mse_loss(model(xs[i]), ys[i]) for i in steps[k]]).sum() / n).backward()
        opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(model(xs[9]), ys[9]).backward()
    opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batches", [(3, 1), (1, 2, 4)])
def test_join_with_uneven_shards(worlds, batches):
    results = worlds.spawn(_uneven, len(batches), args=(batches,))
    ref = _uneven_reference(batches)
    longest = max(range(len(batches)), key=lambda r: (batches[r], r))
    for last, params in results:
        assert last == longest
        for got, want in zip(params, ref, strict=True):
            assert torch.allclose(torch.as_tensor(got), want, atol=1e-6)



def _even_without_join_support(comm):
    """Even shards, join_support=False: the same result as one process; join() refuses clearly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model.named_parameters(), bucket_bytes=100, comm=comm, join_support=False)
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(3, 8, 6, generator=g), torch.randn(3, 8, 3, generator=g)
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        half = slice(4 * comm.rank, 4 * comm.rank + 4)
        nn.functional.mse_loss(model(x[half]), y[half]).backward()
        opt.step()
    try:
        join(comm)
    except JoinError as exc:
        error = str(exc)
    else:
        error = ""
    return [_np(p) for p in model.parameters()], error


@pytest.mark.timeout(90)
def test_without_join_support_steps_match_and_join_refuses(worlds):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(3, 8, 6, generator=g), torch.randn(3, 8, 3, generator=g)
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for params, error in worlds.spawn(_even_without_join_support, 2):
        for got, want in zip(params, model.parameters(), strict=True):
            assert torch.allclose(torch.as_tensor(got), want.detach(), atol=1e-6)
        assert "join_support=False" in error and "join_support=True (the default)" in error


# ----------------------------------------------------------------------------- SyncBatchNorm


def _syncbn(comm):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3), SyncBatchNorm(3, comm=comm), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 1))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * comm.size, 2, 6, 6, generator=g) * 2 + 1
    xs = x[comm.rank * 4 : (comm.rank + 1) * 4].clone().requires_grad_(True)
    out = net(xs)
    # the global objective is the mean over all samples: each rank's share is sum/N_total
    (out.sum() / x.shape[0]).backward()
    grads = {n: _np(p.grad) for n, p in net.named_parameters()}
    for p in net.parameters():  # data parallel: gradients are summed over ranks here
        comm.allreduce(p.grad)
    grads = {n: _np(p.grad) for n, p in net.named_parameters()}
    bn = net[1]
    net.eval()
    evaluated = _np(net(xs))
    return _np(out), _np(xs.grad), grads, _np(bn.running_mean), _np(bn.running_var), evaluated


@pytest.mark.timeout(60)
def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(worlds):
    results = worlds.spawn(_syncbn, 2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 1))
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 2, 6, 6, generator=g) * 2 + 1).requires_grad_(True)
    out = net(x)
    (out.sum() / 8).backward()
    net.eval()
    for r, (o, gx, grads, rm, rv, ev) in enumerate(results):
        sl = slice(r * 4, (r + 1) * 4)
        assert torch.allclose(torch.as_tensor(o), out[sl].detach(), atol=1e-5)
        assert torch.allclose(torch.as_tensor(gx), x.grad[sl], atol=1e-6)
        for n, p in net.named_parameters():
            assert torch.allclose(torch.as_tensor(grads[n]), p.grad, atol=1e-5), n
        assert torch.allclose(torch.as_tensor(rm), net[1].running_mean, atol=1e-6)
        assert torch.allclose(torch.as_tensor(rv), net[1].running_var, atol=1e-6)
        assert torch.allclose(torch.as_tensor(ev), net(x[sl]).detach(), atol=1e-5)


def test_convert_sync_batchnorm_keeps_state():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(0.5)
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], SyncBatchNorm)
    assert torch.equal(converted[1].running_mean, torch.full((4,), 0.5))
    assert converted[1].weight is model[1].weight


# ----------------------------------------------------------------------------- sampler, LR, checkpoint


def _shards(comm, n, drop_last):
    sampler = DistributedSampler(list(range(n)), shuffle=True, seed=3, drop_last=drop_last, comm=comm)
    sampler.set_epoch(1)
    return list(sampler)


@pytest.mark.timeout(60)
def test_sampler_covers_every_sample_once_per_epoch(worlds):
    shards = worlds.spawn(_shards, 3, args=(30, False))
    assert sorted(i for s in shards for i in s) == list(range(30))
    shards = worlds.spawn(_shards, 2, args=(31, True))
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 30


def test_gradual_warmup_ramps_to_the_scaled_rate():
    param = nn.Parameter(torch.zeros(1))
    lr = scale_lr(0.1, 4)
    assert lr == pytest.approx(0.4)
    opt = torch.optim.SGD([param], lr=lr)
    sched = GradualWarmup(opt, warmup_steps=3, multiplier=4)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # lr(t) = 0.4 / 4 * (1 + t * 3 / 3): 0.1, 0.2, 0.3, then 0.4
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    with pytest.raises(ValueError, match="multiplier must be > 0"):
        GradualWarmup(opt, warmup_steps=3, multiplier=0)


def _checkpoint(comm, path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model.named_parameters(), comm=comm)
    opt.zero_grad()
    model(torch.ones(2, 3) * (comm.rank + 1)).sum().backward()
    opt.step()
    save_checkpoint(path, {"model": model, "optimizer": opt, "epoch": 3}, comm=comm)
    loaded = load_checkpoint(path, comm=comm)
    return loaded["epoch"], _np(loaded["model"]["weight"]), _np(model.weight)


@pytest.mark.timeout(60)
def test_checkpoint_written_once_and_loadable_on_another_world_size(worlds, tmp_path):
    path = tmp_path / "ck" / "model.pt"
    results = worlds.spawn(_checkpoint, 2, args=(str(path),))
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no temporary left behind
    for epoch, saved, live in results:
        assert epoch == 3 and (saved == live).all()
    # one process (a different world size) loads it as a plain state
    state = load_checkpoint(path, root_rank=None)
    fresh = nn.Linear(3, 2)
    fresh.load_state_dict(state["model"])
    opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    opt.load_state_dict(state["optimizer"])
    assert opt.param_groups[0]["lr"] == 0.1 and len(opt.state) == 2


# ----------------------------------------------------------------------------- sparse gradients

_SPARSE_ROWS = ([[1, 2, 4, 5], [4, 3, 2, 9]], [[1, 3, 4, 0], [4, 7, 9, 8]])  # rank r's token ids


def _sparse_embedding():
    torch.manual_seed(3)
    return nn.Embedding(10, 3, sparse=True)


def _sparse_steps(comm, sparse_as_dense):
    emb = _sparse_embedding()
    opt = DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1), emb.named_parameters(),
                               comm=comm, sparse_as_dense=sparse_as_dense)
    kinds = []
    for _ in range(3):
        opt.zero_grad()
        (emb(torch.tensor(_SPARSE_ROWS[comm.rank])) ** 2).sum().backward()
        opt.synchronize()
        kinds.append(emb.weight.grad.is_sparse)
        with opt.skip_synchronize():
            opt.step()
    return kinds, _np(emb.weight)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_are_averaged_and_handed_back_sparse_for_sparse_adam(worlds, sparse_as_dense):
    """An embedding with sparse gradients under SparseAdam (which refuses dense ones): the averaged
    gradient comes back sparse with either setting, as Horovod documents for sparse_as_dense, and
    the weights equal one process's on the mean of the two ranks' losses."""
    out = worlds.spawn(_sparse_steps, 2, args=(sparse_as_dense,))
    emb = _sparse_embedding()
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        sum((emb(torch.tensor(rows)) ** 2).sum() for rows in _SPARSE_ROWS).div(2).backward()
        opt.step()
    for kinds, weight in out:
        assert kinds == [True] * 3
        assert torch.allclose(torch.as_tensor(weight), emb.weight.detach(), atol=1e-6)
