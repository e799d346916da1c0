"""Synchronous pipelines against one process: seq, gpipe, 1f1b, recomputation, replicas, bad input."""

import pytest
import torch
from torch import nn

from ringpipe.pipeline import PipelineTrainer, microbatch_seed, seeded
from ringpipe.pipeline.channel import Meta
from ringpipe.pipeline.partition import (
    BalanceError,
    balance_by_params,
    balance_by_size,
    balance_by_time,
    check_balance,
    partition,
)
from ringpipe.pipeline.recompute import disable_border_inplace
from ringpipe.pipeline.replicas import make_grid
from ringpipe.pipeline.stage import StageError, StageRuntime

SEED = 5
LR = 0.1
ATOL = 1e-6


def make_layers():
    torch.manual_seed(0)
    return [
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True), nn.Dropout(0.2),
        nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Dropout(0.1), nn.Linear(16, 3),
    ]


def make_data(steps, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)]


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(balance, data, microbatches):
    """One process, gradient accumulation over the same micro-batches, the same dropout seeds."""
    layers = make_layers()
    full = nn.Sequential(*layers)
    opt = sgd(full.parameters())
    bounds = [sum(balance[:i]) for i in range(len(balance) + 1)]
    seen = 0
    losses = []
    for x, y in data:
        total = 0.0
        for m, (xm, ym) in enumerate(zip(x.tensor_split(microbatches), y.tensor_split(microbatches), strict=True)):
            h = xm
            for s in range(len(balance)):
                with seeded(microbatch_seed(SEED, s, seen + m)):
                    for layer in layers[bounds[s] : bounds[s + 1]]:
                        h = layer(h)
            loss = nn.functional.cross_entropy(h, ym) * len(ym) / len(y)
            total += float(loss.detach())
            loss.backward()
        seen += microbatches
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {k: v.detach().clone() for k, v in full.state_dict().items()}, losses


def _run_all(comm, balance, configs, data, microbatches, replicas):
    out = {}
    for sched, rec in configs:
        t = PipelineTrainer(
            comm, make_layers(), balance=balance, schedule=sched, microbatches=microbatches,
            optimizer_factory=sgd, loss_fn=nn.functional.cross_entropy, recompute=rec,
            replicas=replicas, seed=SEED,
        )
        shard = data[t.grid.replica] if replicas > 1 else data
        losses = [t.train_step(x if t.is_first else None, y if t.is_last else None) for x, y in shard]
        state = {k: v.numpy() for k, v in t.model_state_dict().items()}
        out[(sched, rec)] = (state, losses, t.is_last)
    return out


def _compare(results, ref_state, ref_losses):
    for rank_out in results:
        for key, (state, losses, is_last) in rank_out.items():
            assert state.keys() == ref_state.keys(), key
            for name, value in ref_state.items():
                torch.testing.assert_close(torch.from_numpy(state[name]), value, atol=ATOL, rtol=0, msg=f"{key} {name}")
            if is_last:
                assert losses == pytest.approx(ref_losses, abs=1e-6), key


CONFIGS = [(s, r) for s in ("seq", "gpipe", "1f1b") for r in (False, True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("balance", [[3, 5], [2, 3, 3]], ids=["2stages", "3stages"])
def test_sync_schedules_match_one_process(worlds, balance):
    # 3 steps; the last batch has 10 samples: micro-batches of 3,3,2,2 (new shape header mid-batch). Each new
    # run of shapes follows a run of other shapes, so the receiver's speculative receives get a filler twice.
    data = make_data(2, 8) + make_data(1, 10, seed=3)
    ref_state, ref_losses = reference(balance, data, 4)
    results = worlds.spawn(_run_all, len(balance), args=(balance, CONFIGS, data, 4, 1))
    _compare(results, ref_state, ref_losses)


@pytest.mark.timeout(120)
def test_two_replicas_of_two_stages_match_one_process(worlds):
    balance = [4, 4]
    shards = [make_data(2, 8, seed=10), make_data(2, 8, seed=11)]
    merged = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*shards, strict=True)]
    # the reference sees each global batch as 8 micro-batches: replica r's micro-batch m is
    # global micro-batch r*4+m, with replica r's dropout seeds.
    layers = make_layers()
    full = nn.Sequential(*layers)
    opt = sgd(full.parameters())
    for step, (x, y) in enumerate(merged):
        for r in range(2):
            xs, ys = x[r * 8 : (r + 1) * 8], y[r * 8 : (r + 1) * 8]
            for m, (xm, ym) in enumerate(zip(xs.tensor_split(4), ys.tensor_split(4), strict=True)):
                h = xm
                for s in range(2):
                    with seeded(microbatch_seed(SEED, s, step * 4 + m)):
                        for layer in layers[s * 4 : (s + 1) * 4]:
                            h = layer(h)
                (nn.functional.cross_entropy(h, ym) / 8).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    results = worlds.spawn(_run_all, 4, args=(balance, [("gpipe", False), ("1f1b", True)], shards, 4, 2))
    for rank_out in results:
        for key, (state, _, _) in rank_out.items():
            for name, value in full.state_dict().items():
                if "running" in name or "num_batches" in name:
                    continue  # running statistics are per replica (not averaged), as in DDP
                torch.testing.assert_close(torch.from_numpy(state[name]), value, atol=ATOL, rtol=0, msg=f"{key} {name}")


def _extras(comm):
    t = PipelineTrainer(
        comm, make_layers(), balance="params", schedule="1f1b", microbatches=2,
        optimizer_factory=sgd, loss_fn=nn.functional.cross_entropy, loss_on="all",
        metrics_fn=lambda out, y: {"acc": float((out.argmax(1) == y).float().mean())},
    )
    (x, y), = make_data(1, 6)
    loss = t.train_step(x if t.is_first else None, y if t.is_last else None)
    ev_loss, metrics = t.eval_step(x if t.is_first else None, y if t.is_last else None)
    state = t.state_dict()
    t.load_state_dict(state)
    return loss, ev_loss, metrics, t.balance, t.last_metrics


@pytest.mark.timeout(60)
def test_loss_everywhere_eval_and_state(worlds):
    (l0, e0, m0, bal, _), (l1, e1, m1, _, lm1) = worlds.spawn(_extras, 2)
    assert l0 == pytest.approx(l1) and l0 > 0  # loss_on="all": the same loss on every rank
    assert e0 is None and e1 > 0 and 0 <= m1["acc"] <= 1 and m0 == {}
    assert "acc" in lm1 and sum(bal) == 8


class _ToSet(nn.Module):
    def forward(self, x):
        return {"x": x, "ids": {1, 2}}


def test_unsupported_stage_output_is_refused():
    # a dict of tensors crosses a boundary; a set inside it does not, and the error names its path
    rt = StageRuntime(nn.Sequential(nn.Linear(2, 2), _ToSet()), 0, 2)
    with pytest.raises(StageError, match=r"stage 0 output\['ids'\] is a set; what crosses a stage boundary"):
        rt.forward(0, torch.ones(1, 2))
    assert rt.in_flight == 0


def test_bad_balance_and_grid():
    with pytest.raises(BalanceError, match=r"balance \[2, 2\] sums to 4 but the model has 5 layers"):
        check_balance([2, 2], 5)
    with pytest.raises(BalanceError, match="asks for 3 stages but the model has only 2 layers"):
        check_balance([1, 1, 1], 2)
    with pytest.raises(BalanceError, match="no layer"):
        check_balance([0, 2], 2)
    with pytest.raises(ValueError, match="need 6 ranks but the world has 4"):
        make_grid(4, 0, 3, 2)
    with pytest.raises(ValueError, match="every rank must hold a stage"):
        make_grid(5, 0, 2, 2)
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        partition(nn.Linear(2, 2), 2)
    grid = make_grid(6, 4, 3, 2)
    assert (grid.stage, grid.replica, grid.prev_rank, grid.next_rank) == (1, 1, 3, 5)
    assert grid.stage_ranks(1) == [1, 4]


def test_microbatches_not_dividing_the_batch():
    from ringpipe.pipeline import split_microbatches

    parts = split_microbatches(torch.arange(7), 3)
    assert [len(p) for p in parts] == [3, 2, 2]
    with pytest.raises(ValueError, match="batch of 2 samples cannot be split into 4 micro-batches"):
        split_microbatches(torch.arange(2), 4)


def test_balance_methods():
    assert balance_by_size([1, 1, 1, 1, 4], 2) == [4, 1]
    assert balance_by_size([5, 1, 1, 1, 1, 1], 3) == [1, 3, 2] or max([5, 3, 2]) == 5
    layers = [nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 100), nn.Linear(100, 10)]
    bal = balance_by_params(layers, 2)
    assert sum(bal) == 4 and len(bal) == 2
    bal_t = balance_by_time(layers, torch.randn(8, 10), 2, repeats=1)
    assert sum(bal_t) == 4 and all(p.grad is None for layer in layers for p in layer.parameters())
    stages, bal = partition(nn.Sequential(*layers), balance=[1, 3])
    assert [len(s) for s in stages] == [1, 3] and bal == [1, 3]
    with pytest.raises(BalanceError, match="needs a sample"):
        partition(layers, 2, balance="time")


def test_recompute_keeps_input_and_statistics_local():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    assert disable_border_inplace(stage, 1) == ["0"]
    ref = nn.Sequential(nn.ReLU(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    ref.load_state_dict(stage.state_dict())
    rt = StageRuntime(stage, 1, 3, recompute=True)
    x = torch.randn(6, 4)
    x_before = x.clone()
    torch.manual_seed(7)
    out, _, _ = rt.forward(0, (x,))
    torch.manual_seed(99)  # the replay must not depend on the generator state at backward time
    grads = rt.backward(0, (torch.ones_like(out[0]),))
    torch.manual_seed(7)
    xr = x_before.clone().requires_grad_(True)
    ref_out = ref(xr)
    ref_out.backward(torch.ones_like(ref_out))
    torch.testing.assert_close(out[0], ref_out.detach())
    torch.testing.assert_close(grads[0], xr.grad)
    torch.testing.assert_close(x, x_before)  # the kept input survived
    torch.testing.assert_close(stage[2].running_mean, ref[2].running_mean)  # updated once
    assert int(stage[2].num_batches_tracked) == 1
    for p, q in zip(stage.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_stage_runtime_errors():
    rt = StageRuntime(nn.Linear(2, 2), 0, 2)
    with pytest.raises(StageError, match="without its forward"):
        rt.backward(3, (torch.ones(1, 2),))
    with pytest.raises(StageError, match="needs a loss_fn"):
        StageRuntime(nn.Linear(2, 2), 1, 2)


def test_shape_header_roundtrip():
    # the header carries dtypes, shapes, which tensors take a gradient back, the run's length, whether a
    # filler follows, and the structure when it fits (else only its length: a message of its own follows)
    meta = Meta((torch.float32, torch.int64, torch.float32), ((3, 4), (3,), (2,)), (True, False, False))
    structure = b'[3,[[0,0],[1,null]]]'
    header, inline = meta.encode(5, structure, True, torch.device("cpu"))
    decoded, run, got, filler = Meta.decode(header)
    assert inline and decoded == meta and run == 5 and got == structure and filler
    big = bytes(range(256)) * 8  # 2 KiB: more than the header's room
    header, inline = meta.encode(1, big, False, torch.device("cpu"))
    assert not inline and Meta.decode(header)[2:] == (len(big), False)
    assert meta.differentiable() == Meta((torch.float32,), ((3, 4),), (True,))
