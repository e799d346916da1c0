"""Interleaved 1F1B, ZB-H1 and ZB-H2 train exactly as one process does: the trainer's MLP, CNN, ResNet and transformer.

Oracle: one process holding the unsplit model (built by the same factory from the same seed)
trains on the same global batches with the same optimizer, in plain torch: the gradient of
the batch-mean loss, one SGD-with-momentum step per batch. Models with batch normalisation
(the ResNet) normalise each micro-batch by its own statistics in a pipeline, so for them the
oracle accumulates the same micro-batches' losses, weighted by their share of the batch; the
others take one backward of the whole batch. Every parameter and buffer must agree after
three steps (the last batch splits unevenly: micro-batch losses weighted by size, and the
shape header changes mid-batch).

Real processes over gloo. Every model runs on 2 stages under both schedules; the MLP and the
transformer also on 3 and 4 stages; recomputation and 3 chunks per rank appear on some. ZB-H2
runs the MLP (with and without recomputation) and the transformer on 2 stages, the MLP on 3.
"""

import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ringpipe.pipeline import PipelineTrainer
from ringpipe.train.models import cnn, mlp, resnet, transformer

LR = 0.05
STEPS = 3
IMAGE = SimpleNamespace(name="tiny-images", input_shape=(1, 8, 8), num_classes=3, kind="image")
TOKENS = SimpleNamespace(name="tiny-lm", input_shape=(6,), num_classes=11, kind="lm")


def build(model: str, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    if model == "mlp":
        return mlp(SimpleNamespace(hidden=[12] * depth, dropout=0.0), IMAGE)
    if model == "cnn":
        return cnn(SimpleNamespace(channels=[4] * depth, hidden=16, dropout=0.0), IMAGE)
    if model == "resnet":
        return resnet(SimpleNamespace(width=4, blocks=[1] * depth), IMAGE)
    return transformer(SimpleNamespace(d_model=8, heads=2, ff=16, dropout=0.0, layers=depth), TOKENS)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def make_data(model: str, microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    sizes = [2 * microbatches, 2 * microbatches, 2 * microbatches - 1]
    if model == "transformer":
        return [(torch.randint(0, 11, (n, 6), generator=g), torch.randint(0, 11, (n, 6), generator=g)) for n in sizes]
    return [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def balance_of(layers: nn.Sequential, parts: int) -> list[int]:
    """Near-equal contiguous parts, each cut just before a layer with parameters (so every part trains)."""
    starts = [i for i, layer in enumerate(layers) if any(True for _ in layer.parameters())]
    starts[0] = 0
    assert len(starts) >= parts, f"{len(starts)} layers with parameters cannot fill {parts} parts"
    cuts = [starts[(k * len(starts)) // parts] for k in range(parts)] + [len(layers)]
    return [b - a for a, b in zip(cuts, cuts[1:], strict=False)]


@functools.cache
def oracle(model: str, depth: int, microbatches: int) -> dict[str, torch.Tensor]:
    full = build(model, depth)
    opt = sgd(full.parameters())
    per_microbatch = any(isinstance(m, nn.BatchNorm2d) for m in full.modules())
    for x, y in make_data(model, microbatches):
        if per_microbatch:
            for xm, ym in zip(x.tensor_split(microbatches), y.tensor_split(microbatches), strict=True):
                (loss_fn(full(xm), ym) * len(ym) / len(y)).backward()
        else:
            loss_fn(full(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in full.state_dict().items()}


def _train(comm, runs, stages):
    out = {}
    for run in runs:
        model, depth, schedule, chunks, recompute = run
        m = 2 * stages
        layers = build(model, depth)
        parts = stages * (chunks or 1)
        t = PipelineTrainer(
            comm, layers, balance=balance_of(layers, parts), schedule=schedule, microbatches=m,
            optimizer_factory=sgd, loss_fn=loss_fn, recompute=recompute, chunks=chunks,
        )
        for x, y in make_data(model, m):
            t.train_step(x if t.is_first else None, y if t.is_last else None)
        out[run] = t.model_state_dict()
    return out


def _check(worlds, stages, runs):
    results = worlds.spawn(_train, stages, args=(runs, stages))
    for run in runs:
        model, depth = run[0], run[1]
        expected = oracle(model, depth, 2 * stages)
        for rank_out in results:
            got = rank_out[run]
            assert got.keys() == expected.keys(), run
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, atol=2e-5, rtol=1e-4, msg=f"{run} {name}")


DEPTH = {"mlp": 7, "cnn": 4, "resnet": 3, "transformer": 6}
SCHEDULES = [("interleaved_1f1b", 2), ("zb_h1", None)]


@pytest.mark.timeout(300)
def test_every_model_on_two_stages(worlds):
    runs = [(model, DEPTH[model], s, k, False) for model in DEPTH for s, k in SCHEDULES]
    runs += [("resnet", 3, s, k, True) for s, k in SCHEDULES]  # batch norm under recomputation
    runs += [("mlp", 7, "interleaved_1f1b", 3, True)]  # three chunks per rank
    _check(worlds, 2, runs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stages", [3, 4])
def test_mlp_and_transformer_on_three_and_four_stages(worlds, stages):
    runs = [("mlp", 7, s, k, stages == 4) for s, k in SCHEDULES]
    runs += [("transformer", 6, s, k, stages == 3) for s, k in SCHEDULES]
    _check(worlds, stages, runs)


@pytest.mark.timeout(300)
def test_zb_h2_trains_as_one_process_on_two_and_three_stages(worlds):
    # ZB-H2: up to 2p - 1 micro-batches held, the same backward split as ZB-H1
    _check(worlds, 2, [("mlp", 7, "zb_h2", None, False), ("mlp", 7, "zb_h2", None, True),
               ("transformer", 6, "zb_h2", None, False)])
    _check(worlds, 3, [("mlp", 7, "zb_h2", None, False)])


def _bad(comm):
    layers = build("mlp", 7)
    return PipelineTrainer(comm, layers, schedule="interleaved_1f1b", microbatches=3, optimizer_factory=sgd,
                           loss_fn=loss_fn)


def test_bad_input_is_refused_with_the_fix():
    one_rank = SimpleNamespace(size=1, rank=0)  # refused before any message: no process needed
    with pytest.raises(ValueError, match="several model chunks per rank need schedule 'interleaved_1f1b'"):
        PipelineTrainer(one_rank, build("mlp", 7), schedule="1f1b", chunks=2, optimizer_factory=sgd,
                        loss_fn=loss_fn)
    with pytest.raises(ValueError, match="needs at least 2 stages"):
        PipelineTrainer(one_rank, build("mlp", 7), schedule="interleaved_1f1b", optimizer_factory=sgd,
                        loss_fn=loss_fn)
    with pytest.raises(ValueError, match="not a multiple of chunks=2"):
        PipelineTrainer(one_rank, build("mlp", 7), balance=[5, 6, 5], schedule="interleaved",
                        optimizer_factory=sgd, loss_fn=loss_fn)


@pytest.mark.timeout(120)
def test_microbatches_not_a_multiple_of_stages_is_refused_at_construction(worlds):
    with pytest.raises(Exception, match=r"multiple of stages \(2\).*use 4 micro-batches"):
        worlds.spawn(_bad, 2)


# ---------------------------------------------------------------- the split backward, one process

def _stage_layers(kind: str) -> nn.Sequential:
    torch.manual_seed(3)
    if kind == "inplace":  # ReLU(inplace=True) rewrites the linear layer's output: whole-graph W
        return nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 4))
    if kind == "shared":  # one weight in two layers: whole-graph W
        first = nn.Linear(5, 5)
        return nn.Sequential(first, nn.Tanh(), first, nn.Linear(5, 4))
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 4))


@pytest.mark.parametrize("kind,per_layer", [("plain", True), ("inplace", False), ("shared", False)])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("last", [False, True])
def test_b_then_w_gives_the_gradients_of_one_backward(kind, per_layer, recompute, last):
    from ringpipe.pipeline.split_backward import SplitStageRuntime

    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(2))
    plain = _stage_layers(kind)
    xr = x.clone().requires_grad_(True)
    out = plain(xr)
    if last:
        (nn.functional.cross_entropy(out, y) * 0.5).backward()
    else:
        out.backward(g)

    stage = _stage_layers(kind)
    # stage 1 of 2 is the last (starts from its loss), stage 1 of 3 a middle one (needs its input gradient)
    rt = SplitStageRuntime(stage, 1, 2 if last else 3, nn.functional.cross_entropy if last else None,
                           recompute=recompute)
    rt.forward(0, (x,), target=y if last else None, weight=0.5)
    grads_in = rt.backward_input(0, None if last else (g,))
    assert all(p.grad is None for p in stage.parameters())  # B computed no weight gradient
    assert (rt._pending[0].layers is not None) == per_layer
    assert rt.in_flight == 1
    rt.backward_weight(0)
    assert rt.in_flight == 0
    torch.testing.assert_close(grads_in[0], xr.grad)
    for (name, p), q in zip(stage.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for a, b in zip(stage.buffers(), plain.buffers(), strict=True):  # running statistics moved once
        torch.testing.assert_close(a, b)
