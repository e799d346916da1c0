"""join with uneven shards: learning-rate schedules on the served steps, other collectives while a rank is joined."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from ringpipe.dp import DistributedOptimizer, join

HERE = Path(__file__).resolve().parents[2]  # tests/: the helper scripts and modules
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None
LR, GAMMA = 0.1, 0.5


def _np(t: torch.Tensor):
    return t.detach().clone().numpy()


def _model(wide: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if wide:  # 143,251 parameters: one bucket longer than what rides in a step's announcement (RIDE_CAP)
        return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 2100), nn.Tanh(), nn.Linear(2100, 3))
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


def _uneven_with_schedule(comm, batches, kind, wide=False, compression=None, overlap=True):
    model = _model(wide)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                               model.named_parameters(), bucket_bytes=None if wide else 100, comm=comm,
                               compression=compression, overlap=overlap)
    sched = _scheduler(kind, opt)
    xs, ys = _batches()
    for i in _mine(comm.rank, batches):
        opt.zero_grad()
        nn.functional.mse_loss(model(xs[i]), ys[i]).backward()
        opt.step()
        sched.step()
    last = join(comm)
    return last, [_np(p) for p in model.parameters()], opt.param_groups[0]["lr"]


def _schedule_reference(batches, kind, wide=False):
    """One process: step k sums the losses of the ranks that still had data at step k and divides by
    the number of ranks (Horovod's Average: joined ranks contribute zeros, the size stays)."""
    model = _model(wide)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = _scheduler(kind, opt)
    xs, ys = _batches()
    n = len(batches)
    for k in range(max(batches)):
        opt.zero_grad()
        idx = [k * n + r for r in range(n) if batches[r] > k]
        (torch.stack([nn.functional.mse_loss(model(xs[i]), ys[i]) for i in idx]).sum() / n).backward()
        opt.step()
        sched.step()
    return [p.detach() for p in model.parameters()], opt.param_groups[0]["lr"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("batches", "kind"), [((3, 1), "step"), ((1, 2, 4), "lambda")])
def test_join_serves_steps_with_the_learning_rate_of_the_ranks_with_data(worlds, batches, kind):
    _check_schedule(worlds.spawn(_uneven_with_schedule, len(batches), args=(batches, kind)), batches, kind)


@pytest.mark.timeout(90)
def test_join_serves_steps_whose_buckets_are_held_until_backward_ends(worlds):
    """overlap=False: the ranks with data post every bucket in step(); the joined ranks serve them alike."""
    batches = (1, 2, 4)
    results = worlds.spawn(_uneven_with_schedule, len(batches), args=(batches, "lambda", False, None, False))
    _check_schedule(results, batches, "lambda")


@pytest.mark.timeout(90)
def test_join_serves_steps_whose_first_bucket_is_longer_than_the_announcement_carries(worlds):
    """One bucket of 143,251 gradients: its start rides in the step's announcement, the rest follows it."""
    from ringpipe.check.announcement import RIDE_CAP

    assert sum(p.numel() for p in _model(wide=True).parameters()) > RIDE_CAP
    batches = (3, 1)
    results = worlds.spawn(_uneven_with_schedule, len(batches), args=(batches, "step", True))
    _check_schedule(results, batches, "step", wide=True)


@pytest.mark.timeout(90)
def test_join_serves_steps_with_fp16_compression(worlds):
    """An fp16 wire: nothing rides in the announcement (it is float32); the buckets follow it."""
    batches = (3, 1)
    results = worlds.spawn(_uneven_with_schedule, len(batches), args=(batches, "step", True, "fp16"))
    _check_schedule(results, batches, "step", wide=True, atol=2e-3)


def _check_schedule(results, batches, kind, wide=False, atol=1e-6):
    ref, ref_lr = _schedule_reference(batches, kind, wide)
    longest = max(range(len(batches)), key=lambda r: (batches[r], r))
    for rank, (last, params, lr) in enumerate(results):
        assert last == longest
        for got, want in zip(params, ref, strict=True):
            assert torch.allclose(torch.as_tensor(got), want, atol=atol), rank
        for got, first in zip(params, results[0][1], strict=True):
            assert (got == first).all(), f"rank {rank} differs from rank 0 after join"
        # every rank leaves join with the hyper-parameters of the rank that joined last
        assert lr == pytest.approx(ref_lr), rank


def _uneven_with_clipping(comm, batches):
    """Clipped gradients (synchronize, clip, step under skip_synchronize) with uneven shards."""
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                               model.named_parameters(), bucket_bytes=100, comm=comm)
    xs, ys = _batches()
    for i in _mine(comm.rank, batches):
        opt.zero_grad()
        (10.0 * nn.functional.mse_loss(model(xs[i]), ys[i])).backward()
        opt.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with opt.skip_synchronize():
            opt.step()
    last = join(comm)
    momenta = [_np(opt.state[p]["momentum_buffer"]) for p in model.parameters()]
    return last, [_np(p) for p in model.parameters()], momenta


CLIP = 0.05


def _clipping_reference(batches):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    xs, ys = _batches()
    n = len(batches)
    for k in range(max(batches)):
        opt.zero_grad()
        idx = [k * n + r for r in range(n) if batches[r] > k]
        (10.0 * torch.stack([nn.functional.mse_loss(model(xs[i]), ys[i]) for i in idx]).sum() / n).backward()
        assert nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP  # clipping changes every step
        opt.step()
    return [p.detach() for p in model.parameters()], [opt.state[p]["momentum_buffer"] for p in model.parameters()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batches", [(3, 1), (1, 2, 4)])
def test_join_with_clipped_gradients_leaves_every_rank_with_the_same_weights(worlds, batches):
    """A joined rank applies the reduced gradients unclipped; join then gives it the last rank's weights and state."""
    results = worlds.spawn(_uneven_with_clipping, len(batches), args=(batches,))
    ref, ref_momenta = _clipping_reference(batches)
    for rank, (_, params, momenta) in enumerate(results):
        for got, want in zip(params, ref, strict=True):
            assert torch.allclose(torch.as_tensor(got), want, atol=1e-6), rank
        for got, want in zip(momenta, ref_momenta, strict=True):
            assert torch.allclose(torch.as_tensor(got), want, atol=1e-6), rank
        for got, first in zip(params + momenta, results[0][1] + results[0][2], strict=True):
            assert (got == first).all(), f"rank {rank} differs from rank 0 after join"


# ----------------------------------------------------------------------------- other collectives during join


def _bn_model(comm) -> nn.Module:
    from ringpipe.dp import SyncBatchNorm

    torch.manual_seed(0)
    bn = SyncBatchNorm(8, comm=comm) if comm is not None else nn.BatchNorm1d(8)
    return nn.Sequential(nn.Linear(6, 8), bn, nn.Tanh(), nn.Linear(8, 3))


def _flat(nested) -> list[float]:
    return [x for item in nested for x in (_flat(item) if isinstance(item, list) else [item])]


def _uneven_syncbn_and_metrics(comm, batches):
    """SyncBatchNorm in every forward and metric reductions after every step, with uneven shards."""
    import ringpipe.api as hvd

    hvd.init(comm=comm)
    try:
        model = _bn_model(comm)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                   model.named_parameters(), bucket_bytes=100, comm=comm)
        xs, ys = _batches()
        metrics = []
        for i in _mine(comm.rank, batches):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xs[i]), ys[i])
            loss.backward()
            opt.step()
            mine = torch.tensor([float(i), 1.0])
            metrics.append([
                hvd.allreduce(mine).tolist(),  # Average: joined ranks add zeros, divided by the full size
                hvd.allreduce(mine, op=hvd.Sum).tolist(),
                hvd.allreduce(mine, op=hvd.Min).tolist(),
                hvd.allreduce(mine, op=hvd.Max).tolist(),
                hvd.synchronize(hvd.allreduce_async_(mine.clone(), op=hvd.Product)).tolist(),
                [t.tolist() for t in hvd.grouped_allreduce_([mine.clone(), mine[:1].clone()])],
            ])
            hvd.barrier()
        last = join(comm)
        return last, [_np(p) for p in model.parameters()], metrics
    finally:
        hvd.shutdown()


def _syncbn_reference(batches):
    model = _bn_model(None)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    xs, ys = _batches()
    n = len(batches)
    metrics = {}
    for k in range(max(batches)):
        opt.zero_grad()
        idx = [k * n + r for r in range(n) if batches[r] > k]
        # one batch norm over the samples of every rank with data; the loss is the sum of their losses
        # divided by the number of ranks (Horovod's Average with joined ranks)
        out = model(torch.cat([xs[i] for i in idx]))
        losses = [nn.functional.mse_loss(o, ys[i]) for o, i in zip(out.split(4), idx, strict=True)]
        (torch.stack(losses).sum() / n).backward()
        opt.step()
        m = torch.tensor([[float(i), 1.0] for i in idx])
        avg = m.sum(0) / n
        metrics[k] = [avg.tolist(), m.sum(0).tolist(), m.min(0).values.tolist(), m.max(0).values.tolist(),
                      m.prod(0).tolist(), [avg.tolist(), avg[:1].tolist()]]
    return [p.detach() for p in model.parameters()], metrics


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batches", [(3, 1), (1, 2, 4)])
def test_joined_ranks_take_part_in_syncbatchnorm_and_allreduce(worlds, batches):
    _check_syncbn_and_metrics(worlds.spawn(_uneven_syncbn_and_metrics, len(batches), args=(batches,)), batches)


def _check_syncbn_and_metrics(results, batches):
    ref, ref_metrics = _syncbn_reference(batches)
    for rank, (_, params, metrics) in enumerate(results):
        for got, want in zip(params, ref, strict=True):
            assert torch.allclose(torch.as_tensor(got), want, atol=1e-5), rank
        assert len(metrics) == batches[rank]
        for k, got in enumerate(metrics):
            assert _flat(got) == pytest.approx(_flat(ref_metrics[k])), (rank, k)


def _unservable(comm, op):
    """Rank 1 joins at once; rank 0 calls a collective a joined rank cannot take part in, then joins.

    Returns what the call raised on rank 0, and on rank 1 what join() raised (None: it went on).
    """
    import ringpipe.api as hvd

    hvd.init(comm=comm)
    try:
        if comm.rank == 1:
            join(comm)
            return None
        try:
            if op == "broadcast":
                hvd.broadcast(torch.ones(3), root_rank=0)
            elif op == "allgather":
                hvd.allgather(torch.ones(3))
            elif op == "broadcast_object":
                hvd.broadcast_object({"a": 1})
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return f"{type(exc).__name__}: {exc}"
        finally:
            join(comm)
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        hvd.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["broadcast", "allgather", "broadcast_object"])
def test_collective_a_joined_rank_cannot_serve_is_an_error_on_the_caller_only(worlds, op):
    _check_unservable(worlds.spawn(_unservable, 2, args=(op,)), op)


def _check_unservable(results, op):
    on_data_rank, on_joined_rank = results
    # Horovod: the error goes to the rank that asked; the joined rank's join() goes on
    assert on_joined_rank is None
    assert on_data_rank is not None and "JoinError" in on_data_rank
    name = {"broadcast_object": "broadcast"}.get(op, op).capitalize()
    assert f"{name} is not supported with Join at this time." in on_data_rank
    assert op in on_data_rank and "rank 1" in on_data_rank and "joined" in on_data_rank


# ----------------------------------------------------------------------------- MPI

MPI_BATCHES = (3, 1)


def mpi_main(out_dir: str) -> None:
    """Entry point under mpirun: every join scenario above with the MPI communicator."""
    from ringpipe.comm import init_world

    torch.set_num_threads(1)
    comm = init_world("mpi")
    results = {
        "schedule": _uneven_with_schedule(comm, MPI_BATCHES, "step"),
        "syncbn": _uneven_syncbn_and_metrics(comm, MPI_BATCHES),
        "unservable": _unservable(comm, "broadcast"),
    }
    with open(os.path.join(out_dir, f"rank{comm.rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_join_on_mpi(mpi_jobs):
    out = mpi_jobs.run("dp_join")  # its mpi entry point above on 2 ranks, writing into its folder
    per_rank = [pickle.loads((out.folder / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    _check_schedule([r["schedule"] for r in per_rank], MPI_BATCHES, "step")
    _check_syncbn_and_metrics([r["syncbn"] for r in per_rank], MPI_BATCHES)
    _check_unservable([r["unservable"] for r in per_rank], "broadcast")


def _settle_while_another_thread_reads(comm):
    """The step's first message is being read on one thread (step() waiting on it) while the engine
    thread settles before its next collective: settle must wait for that read, whose on_note tells
    the engine how many ranks have data (whether to announce the next bucket)."""
    import threading
    import time

    from ringpipe.check.announcement import settle, start_exchange
    from ringpipe.comm.base import Work

    seen = []
    wire = torch.ones(8)
    pending = start_exchange(comm, "step", wire, 0, 0, on_note=lambda note: seen.append(note.count))
    arrived = threading.Event()
    inner = pending.work
    pending.work = Work(lambda: (arrived.wait(5), inner.wait()), lambda: arrived.is_set())
    reader = threading.Thread(target=pending.note)
    reader.start()
    time.sleep(0.2)  # the reader holds the message, waiting for it to arrive
    settled = threading.Thread(target=settle, args=(comm,))
    settled.start()
    time.sleep(0.2)
    waited = settled.is_alive() and not seen  # settle has not returned before the note was read
    arrived.set()
    settled.join(5)
    reader.join(5)
    return waited, seen


@pytest.mark.timeout(60)
def test_settle_waits_for_a_read_of_the_step_header_in_progress_on_another_thread(worlds):
    (waited, seen), = worlds.spawn(_settle_while_another_thread_reads, 1)
    assert waited, "settle returned while the step's header was still being read on another thread"
    assert seen == [1]  # on_note ran once, before settle returned
