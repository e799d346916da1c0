"""The asynchronous 1F1B pipeline on real processes against the single-process simulator."""

import itertools

import pytest
import torch
from torch import nn

from ringpipe.launch import spawn
from ringpipe.pipeline import PipelineTrainer
from ringpipe.pipeline.executor import staleness_of
from ringpipe.pipeline.partition import split_layers
from ringpipe.pipeline.schedules import async_1f1b, async_1f1b_window, async_staleness
from ringpipe.pipeline.simulator import simulate_async
from ringpipe.pipeline.stage import StageRuntime

ATOL = 1e-5
MICRO = 2  # micro-batches per batch
BATCHES = 4  # -> 8 micro-batches streamed without flush

MITIGATIONS = ["stale", "ws", "wp", "wp+ws", "ga", "ws+ga", "wp+ws+ga", "ws+ga_jfl"]


def make_layers():
    torch.manual_seed(0)
    return [nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)]


def make_data():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(BATCHES)]


def make_opt(kind):
    """``kind``: ``sgd``, ``adam`` or ``adamw``, with ``+sched`` for an LR scheduler (see make_sched)."""
    kind = kind.removesuffix("+sched")
    if kind == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=0.01)
    if kind == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05)
    return lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9, weight_decay=1e-3)


def make_sched(kind):
    """A warmup: the rate changes at every step, so scheduler-aware prediction looks ahead at other rates."""
    if not kind.endswith("+sched"):
        return None
    return lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=8)


def configs():
    out = []
    for names, rec, k in itertools.product(MITIGATIONS, (False, True), (1, 2)):
        if names == "ws+ga_jfl" and not rec:
            continue  # ga_jfl needs recomputation (refused otherwise)
        out.append((names, rec, k, "sgd"))
    out += [("wp+ws+ga", False, 1, "adam"), ("wp+ws", True, 2, "adam")]
    out += [
        ("wp+ga", False, 1, "sgd"),  # Gap Aware from the gradient, on predicted forwards
        ("wp+ws+ga_jfl", True, 2, "sgd"),  # aggmsnag, one stash per step, backward on current weights
        ("wp+ws+ga", False, 1, "adamw"),
        ("wp+ws", False, 1, "adamw+sched"),  # scheduler-aware prediction (d = 2 on 3 stages)
        ("wp", True, 1, "sgd+sched"),
    ]
    return out


def _run(comm, balance, cfgs, driver="train_stream"):
    data = make_data()
    out = {}
    for names, rec, k, opt in cfgs:
        t = PipelineTrainer(
            comm, make_layers(), balance=balance, schedule="async", microbatches=MICRO,
            optimizer_factory=make_opt(opt), loss_fn=nn.functional.cross_entropy,
            recompute=rec, mitigations=names, step_every=k, scheduler_factory=make_sched(opt),
        )
        batches = [(x if t.is_first else None, y if t.is_last else None) for x, y in data]
        if driver == "train_stream":
            t.train_stream(batches, len(batches))
        else:  # batch by batch, as mode async of ringpipe train does
            for x, y in batches:
                t.stream_step(x, y)
            assert t.streaming
            t.drain()
            assert not t.streaming and t.in_flight == 0
        got = t.model_state_dict()
        if comm.rank == 0:
            # compared here: results travel back through a pipe, so keep them small
            expected = _simulate(balance, names, rec, k, opt)
            initial = nn.Sequential(*make_layers()).state_dict()
            err = max(float((got[n] - v).abs().max()) for n, v in expected.items())
            moved = max(float((initial[n] - v).abs().max()) for n, v in expected.items())
            out[(names, rec, k, opt)] = (err, moved)
    return out


def _simulate(balance, names, rec, k, opt):
    stages = split_layers(make_layers(), balance)
    optimizers = [make_opt(opt)(list(s.parameters())) for s in stages]
    sched = make_sched(opt)
    schedulers = [sched(o) for o in optimizers] if sched is not None else None
    micro = [(xm, ym) for x, y in make_data() for xm, ym in zip(x.tensor_split(MICRO), y.tensor_split(MICRO), strict=True)]
    simulate_async(stages, optimizers, nn.functional.cross_entropy, micro, names, step_every=k, recompute=rec,
                   schedulers=schedulers)
    return {k2: v.detach() for k2, v in nn.Sequential(*[m for s in stages for m in s]).state_dict().items()}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("balance", [[3, 4], [3, 2, 2]], ids=["2stages", "3stages"])
def test_async_matches_simulator(balance):
    cfgs = configs()
    errors = spawn(_run, len(balance), args=(balance, cfgs))[0]
    assert set(errors) == set(cfgs)
    for cfg, (err, moved) in errors.items():
        assert err <= ATOL, f"{cfg}: async run differs from the simulator by {err}"
        assert moved > 1e-3, f"{cfg}: the weights did not move"


@pytest.mark.timeout(60)
def test_stream_steps_match_simulator():
    """Batch by batch (stream_step, then drain) equals one stream: in flight across batch boundaries."""
    cfgs = [("wp+ws", False, 2, "sgd"), ("stale", True, 1, "sgd"), ("ws+ga", False, 1, "sgd")]
    errors = spawn(_run, 3, args=([3, 2, 2], cfgs, "stream_step"))[0]
    for cfg, (err, moved) in errors.items():
        assert err <= ATOL, f"{cfg}: stream_step run differs from the simulator by {err}"
        assert moved > 1e-3, f"{cfg}: the weights did not move"


@pytest.mark.parametrize(("stages", "micro", "k", "batches"), [(2, 2, 2, 3), (3, 2, 1, 4), (4, 3, 3, 2), (3, 4, 2, 1)])
def test_stream_windows_concatenate_to_the_async_schedule(stages, micro, k, batches):
    total = micro * batches
    for stage in range(stages):
        got = []
        for b in range(batches):
            got += async_1f1b_window(stages, stage, b * micro, (b + 1) * micro, k)
        got += async_1f1b_window(stages, stage, total, total, k, total=total)
        assert got == async_1f1b(stages, total, stage, k)
        expected = staleness_of(got)
        assert {mb: async_staleness(stages, stage, mb, k) for mb in range(total)} == expected
    # a trailing partial group gets its step in the drain, after the last window
    assert [str(a) for a in async_1f1b_window(2, 1, 3, 3, 2, total=3)] == ["S"]


def _stale_differs(comm):
    # With staleness the async run must differ from the synchronous one (it is not a flush).
    data = make_data()
    states = []
    for sched in ("async", "1f1b"):
        t = PipelineTrainer(comm, make_layers(), balance=[3, 4], schedule=sched, microbatches=MICRO,
                            optimizer_factory=make_opt("sgd"), loss_fn=nn.functional.cross_entropy)
        for x, y in data:
            t.train_step(x if t.is_first else None, y if t.is_last else None)
        states.append(t.model_state_dict())
    return max(float((states[0][n] - states[1][n]).abs().max()) for n in states[0])


@pytest.mark.timeout(60)
def test_async_is_not_a_flush_and_bad_options_refused():
    assert max(spawn(_stale_differs, 2)) > 1e-4
    with pytest.raises(ValueError, match="apply to schedule 'async_1f1b' only"):
        PipelineTrainer(_FakeComm(), make_layers(), balance=[7], schedule="gpipe",
                        optimizer_factory=make_opt("sgd"), loss_fn=nn.functional.cross_entropy, mitigations="ws")
    with pytest.raises(ValueError, match="step_every=2 applies to the asynchronous schedule only"):
        PipelineTrainer(_FakeComm(), make_layers(), balance=[7], schedule="1f1b", step_every=2,
                        optimizer_factory=make_opt("sgd"), loss_fn=nn.functional.cross_entropy)
    sync = PipelineTrainer(_FakeComm(), make_layers(), balance=[7], schedule="1f1b",
                           optimizer_factory=make_opt("sgd"), loss_fn=nn.functional.cross_entropy)
    with pytest.raises(ValueError, match="stream_step needs schedule 'async_1f1b'"):
        sync.stream_step(*make_data()[0])
    uneven = PipelineTrainer(_FakeComm(), make_layers(), balance=[7], schedule="async", microbatches=3,
                             step_every=2, optimizer_factory=make_opt("sgd"), loss_fn=nn.functional.cross_entropy)
    with pytest.raises(ValueError, match="step_every=2 to divide microbatches=3"):
        uneven.stream_step(*make_data()[0])


class _FakeComm:
    """Argument checks happen before any communication: a stand-in that is never used."""

    size, rank, backend = 1, 0, "gloo"


class _DoubleInPlace(nn.Module):
    def forward(self, x):
        return x.mul_(2)


@pytest.mark.parametrize("live", [False, True], ids=["sync", "async"])
def test_in_place_on_a_saved_activation_raises_with_kept_graphs(live):
    """Kept graphs read parameters live, but an overwritten activation is still an error, not a wrong gradient."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), _DoubleInPlace())
    rt = StageRuntime(module, stage=0, num_stages=2, live_weights=live)
    rt.forward(0, (torch.randn(3, 4),))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        rt.backward(0, (torch.ones(3, 4),))


def test_kept_graph_reads_the_current_weights():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    rt = StageRuntime(module, stage=1, num_stages=3, live_weights=True)
    x, g = torch.randn(3, 4), torch.randn(3, 2)
    rt.forward(0, (x,))
    h = torch.tanh(module[0](x)).detach()  # the forward-time activation
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)  # an optimizer step between forward and backward
    (dx,) = rt.backward(0, (g,))
    dh = (g @ module[2].weight) * (1 - h**2)  # current weights carry the gradient, saved activations stay
    torch.testing.assert_close(dx, dh @ module[0].weight)
    torch.testing.assert_close(module[2].weight.grad, g.t() @ h)
