"""The asynchronous 1F1B pipeline on real processes against a one-process reference from the papers.

The reference (``tests/unit/pipeline/test_pipeline_reference.py``) shares no code with ringpipe's staleness
package or its simulator: it writes the schedule, the stage's forward and backward, the
optimizers, weight stashing, weight prediction and Gap Aware out by hand. Every run here must
end with the same weights, for every mitigation and combination, with SGD in both momentum
forms, Adam and AdamW, ``step_every`` 1 and 2, with and without recomputation, on 2, 3 and 4
stages, with and without an LR warm-up, and with a parameter group at rate 0.
"""

import copy
import dataclasses
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from ringpipe.pipeline import PipelineTrainer
from ringpipe.pipeline.executor import staleness_of
from ringpipe.pipeline.schedules import async_1f1b, async_1f1b_window, async_staleness
from ringpipe.pipeline.stage import StageRuntime
from ringpipe.pipeline.staleness import SutskeverSGD
from unit.pipeline.test_pipeline_reference import Config, Opt, reference_async

DT = torch.float64
ATOL = 1e-10
MICRO = 2  # micro-batches per batch
BATCHES = 5  # -> 10 micro-batches streamed without flush
BALANCE = {2: [3, 4], 3: [3, 2, 2], 4: [2, 2, 2, 1]}

#: name -> (ringpipe mitigations, nag_with_predictor)
MITIGATIONS = {
    "stale": ("stale", False),
    "ws": ("ws", False),
    "wp": ("wp", False),
    "wp+ws": ("wp+ws", False),
    "ga": ("ga", False),
    "wp+ga": ("wp+ga", False),
    "ws+ga": ("ws+ga", False),
    "wp+ws+ga": ("wp+ws+ga", False),
    "ws+ga_jfl": ("ws+ga_jfl", False),
    "wp+ws+ga_jfl": ("wp+ws+ga_jfl", False),
    "wp/nag": ("wp", True),
    "wp+ws+ga/nag": ("wp+ws+ga", True),
}

OPTS = {
    "sgd": Opt("sgd", lr=0.1, weight_decay=0.01),
    "sutskever": Opt("sutskever", lr=0.1, weight_decay=0.01),
    "adam": Opt("adam", lr=0.02, weight_decay=0.01),
    "adamw": Opt("adamw", lr=0.02, weight_decay=0.05),
}
WARMUP = (0.1, 6)


_LAYERS: list[nn.Module] = []


def make_layers():
    """The model's layers under seed 0, a fresh copy each call (built once: seeding costs more than the run)."""
    if not _LAYERS:
        torch.manual_seed(0)
        _LAYERS.extend([nn.Linear(4, 6, dtype=DT), nn.Tanh(), nn.Linear(6, 6, dtype=DT), nn.Tanh(),
                        nn.Linear(6, 6, dtype=DT), nn.Tanh(), nn.Linear(6, 3, dtype=DT)])
    return copy.deepcopy(_LAYERS)


def make_data():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(6, 4, generator=g, dtype=DT), torch.randn(6, 3, generator=g, dtype=DT))
            for _ in range(BATCHES)]


def optimizer_factory(opt: Opt):
    def build(ps):
        groups = [{"params": ps[:1], "lr": 0.0}, {"params": ps[1:]}] if opt.lr0_first else [{"params": ps}]
        if opt.kind == "sgd":
            return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
        if opt.kind == "sutskever":
            return SutskeverSGD(groups, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
        cls = torch.optim.Adam if opt.kind == "adam" else torch.optim.AdamW
        return cls(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)

    return build


def scheduler_factory(opt: Opt):
    if opt.warmup is None:
        return None
    return lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=opt.warmup[0], total_iters=opt.warmup[1])


def ga_stages_for(name: str, stages: int) -> str:
    """Gap Aware without a stash is the staleness-1 estimate: only the stage before the last there."""
    names = MITIGATIONS[name][0].split("+")
    return "almost_last_partition" if "ga" in names and "ws" not in names and stages > 2 else "all_except_last"


def reference_config(name: str, stages: int, k: int, recompute: bool) -> Config:
    names, nag = MITIGATIONS[name]
    chosen = set(names.split("+"))
    return Config(
        ws="ws" in chosen,
        predict=("msnag" if k == 1 else "aggmsnag") if "wp" in chosen else None,
        nag=nag,
        ga="ga" if "ga" in chosen else "ga_jfl" if "ga_jfl" in chosen else None,
        ga_stages=ga_stages_for(name, stages),
        step_every=k,
        recompute=recompute,
    )


def valid(name: str, opt: Opt, recompute: bool) -> bool:
    names = MITIGATIONS[name][0].split("+")
    if "ga_jfl" in names and not recompute:
        return False  # refused: ga_jfl replays the backward on the current weights
    if "ga" in names and "ws" not in names and opt.kind in ("adam", "adamw"):
        return False  # refused: Adam's gap is measured against a stash
    return True


def configs(stages: int, names=tuple(MITIGATIONS)) -> list[tuple]:
    out = []
    for name, kind, k, rec, warm, lr0 in itertools.product(
        names, OPTS, (1, 2), (False, True), (None, WARMUP), (False, True)
    ):
        opt = dataclasses.replace(OPTS[kind], warmup=warm, lr0_first=lr0)
        if valid(name, opt, rec):
            out.append((name, opt, k, rec))
    return out


def _train(comm, stages, cfgs, driver="train_stream"):
    data = make_data()
    out = {}
    for name, opt, k, rec in cfgs:
        names, nag = MITIGATIONS[name]
        options = {"ga_stages": ga_stages_for(name, stages)}
        if nag:
            options["nag_with_predictor"] = True
        t = PipelineTrainer(
            comm, make_layers(), balance=BALANCE[stages], schedule="async", microbatches=MICRO,
            optimizer_factory=optimizer_factory(opt), loss_fn=nn.functional.mse_loss, recompute=rec,
            mitigations=names, step_every=k, scheduler_factory=scheduler_factory(opt),
            mitigation_options=options,
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
        # this stage's W, b of each layer in order: the ranks' parts, in rank order, are the whole
        # model's in the order of nn.Sequential(*layers).state_dict(), as the reference gives them
        # (sent back with the check's result rather than gathered by the ranks after every run)
        out[(name, opt, k, rec)] = torch.cat([v.detach().flatten() for v in t.module.state_dict().values()])
    return out


def _whole(per_rank: list[dict]) -> dict:
    """Each run's final weights, the stages' parts joined in rank (stage) order."""
    return {cfg: torch.cat([part[cfg] for part in per_rank]) for cfg in per_rank[0]}


def expected(stages, name, opt, k, rec):
    """The reference's final weights, flattened in the order of ``nn.Sequential(*layers).state_dict()``."""
    layers = make_layers()
    parts, start = [], 0
    for size in BALANCE[stages]:
        chunk = layers[start:start + size]
        start += size
        kinds = ["linear" if isinstance(m, nn.Linear) else "tanh" for m in chunk]
        parts.append((kinds, [p.detach().clone() for m in chunk for p in m.parameters()]))
    micro = [(xm, ym) for x, y in make_data() for xm, ym in zip(x.tensor_split(MICRO), y.tensor_split(MICRO), strict=True)]
    final = reference_async(parts, opt, reference_config(name, stages, k, rec), micro)
    return torch.cat([t.flatten() for stage in final for t in stage])


def initial():
    return torch.cat([v.flatten() for v in nn.Sequential(*make_layers()).state_dict().values()])


def _check(stages, results, cfgs, wanted=None):
    """Every run ended on the reference's weights (``wanted``: those computed already, by config)."""
    assert set(results) == set(cfgs)
    start = initial()
    bad = []
    for cfg, got in results.items():
        want = wanted[cfg] if wanted is not None else expected(stages, *cfg)
        err = float((got - want).abs().max())
        moved = float((want - start).abs().max())
        if err > ATOL or moved < 1e-3:
            bad.append(f"{cfg[0]} {cfg[1].kind} warmup={cfg[1].warmup is not None} lr0={cfg[1].lr0_first} "
                       f"step_every={cfg[2]} recompute={cfg[3]}: error {err:.3g}, moved {moved:.3g}")
    assert not bad, f"{len(bad)} of {len(results)} runs differ from the reference:\n" + "\n".join(bad[:40])


@pytest.mark.slow  # 640 runs per world size, minutes in all: with the e2e tier, out of the inner loop
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_async_matches_the_reference(worlds, stages):
    cfgs = configs(stages)
    # the reference runs in this process while the ranks train (this process only waits for them);
    # the ranks are forked before its thread starts
    worlds.world(stages).ready()
    with ThreadPoolExecutor(1) as pool:
        wanted = pool.submit(lambda: {cfg: expected(stages, *cfg) for cfg in cfgs})
        results = _whole(worlds.spawn(_train, stages, args=(stages, cfgs)))
        _check(stages, results, cfgs, wanted.result())


@pytest.mark.timeout(300)
def test_stream_steps_match_the_reference(worlds):
    """Batch by batch (stream_step, then drain) equals one stream: in flight across batch boundaries."""
    cfgs = [("wp+ws", OPTS["sgd"], 1, False), ("stale", OPTS["adam"], 1, True),
            ("ws+ga", dataclasses.replace(OPTS["sgd"], warmup=WARMUP), 1, False)]
    _check(3, _whole(worlds.spawn(_train, 3, args=(3, cfgs, "stream_step"))), cfgs)


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
                            optimizer_factory=optimizer_factory(OPTS["sgd"]), loss_fn=nn.functional.mse_loss)
        for x, y in data:
            t.train_step(x if t.is_first else None, y if t.is_last else None)
        states.append(t.model_state_dict())
    return max(float((states[0][n] - states[1][n]).abs().max()) for n in states[0])


@pytest.mark.timeout(300)  # spawns 2 ranks and imports torch.optim's compiler on a loaded machine
def test_async_is_not_a_flush_and_bad_options_refused(worlds):
    assert max(worlds.spawn(_stale_differs, 2)) > 1e-4
    with pytest.raises(ValueError, match="apply to schedule 'async_1f1b' only"):
        PipelineTrainer(_FakeComm(), make_layers(), balance=[7], schedule="gpipe",
                        optimizer_factory=optimizer_factory(OPTS["sgd"]), loss_fn=nn.functional.mse_loss, mitigations="ws")
    with pytest.raises(ValueError, match="step_every=2 applies to the asynchronous schedule only"):
        PipelineTrainer(_FakeComm(), make_layers(), balance=[7], schedule="1f1b", step_every=2,
                        optimizer_factory=optimizer_factory(OPTS["sgd"]), loss_fn=nn.functional.mse_loss)
    sync = PipelineTrainer(_FakeComm(), make_layers(), balance=[7], schedule="1f1b",
                           optimizer_factory=optimizer_factory(OPTS["sgd"]), loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match="stream_step needs schedule 'async_1f1b'"):
        sync.stream_step(*make_data()[0])
    uneven = PipelineTrainer(_FakeComm(), make_layers(), balance=[7], schedule="async", microbatches=3,
                             step_every=2, optimizer_factory=optimizer_factory(OPTS["sgd"]), loss_fn=nn.functional.mse_loss)
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
