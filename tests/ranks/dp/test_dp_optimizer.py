"""DistributedOptimizer: N ranks with batch b reach the parameters of one process with batch N*b.

Every configuration (SGD with momentum and Adam; small and large buckets; every allreduce
algorithm; backward_passes_per_step=2; fp16/bf16 compression; Sum; predivide; parameters
without gradients) trains 3 steps on real processes over gloo and, in one test, under mpirun
with the MPI communicator; the reference is one process on the global batch.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ringpipe.check.announcement import announcement_bytes
from ringpipe.dp import Compression, DistributedOptimizer

HERE = Path(__file__).resolve().parents[2]  # tests/: the helper scripts and modules
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None
STEPS, B = 3, 4


def algorithms() -> list[str]:
    try:
        from ringpipe import collectives
    except ImportError:
        return ["native"]
    names = getattr(collectives, "SUPPORTED", {}).get("allreduce", getattr(collectives, "ALGORITHMS", ()))
    return ["native", *[a for a in names if a != "native"]]


class Branchy(nn.Module):
    """A trunk, a head used only by rank 0's data and a head no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.trunk(x)
        return self.head(h) + (self.extra(h) if use_extra else 0)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "branchy":
        return Branchy()
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def make_opt(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def forward(model: nn.Module, cfg: dict, x: torch.Tensor, rank: int) -> torch.Tensor:
    if cfg.get("model") == "branchy":
        return model(x, use_extra=rank == 0)
    return model(x)


def configs() -> list[dict]:
    out = []
    for opt in ("sgd", "adam"):
        for bucket in (64, 1 << 22):  # one bucket per tensor or so / everything in one bucket
            for alg in algorithms():
                out.append({"opt": opt, "bucket": bucket, "alg": alg})
    out += [
        {"opt": "sgd", "bucket": 256, "bpps": 2},
        {"opt": "adam", "bucket": 1 << 22, "bpps": 2},
        {"opt": "sgd", "bucket": 256, "compression": "fp16", "tol": 2e-3},
        {"opt": "sgd", "bucket": 1 << 22, "compression": "bf16", "tol": 2e-2},
        {"opt": "sgd", "bucket": 256, "op": "sum"},
        {"opt": "adam", "bucket": 256, "predivide": 2.0},
        {"opt": "sgd", "bucket": 64, "model": "branchy"},
        {"opt": "adam", "bucket": 1 << 22, "model": "branchy"},
        {"opt": "sgd", "bucket": 64, "overlap": "after_backward"},
        {"opt": "adam", "bucket": 256, "bpps": 2, "overlap": False, "model": "branchy"},
    ]
    return out


def train_distributed(comm, cfgs: list[dict]) -> list[list]:
    """Run every configuration on this rank; return the final parameters of each."""
    results = []
    for cfg in cfgs:
        model = make_model(cfg.get("model", "mlp"))
        opt = DistributedOptimizer(
            make_opt(cfg["opt"], model),
            named_parameters=model.named_parameters(),
            compression=Compression.parse(cfg.get("compression")),
            backward_passes_per_step=cfg.get("bpps", 1),
            op=cfg.get("op", "average"),
            gradient_predivide_factor=cfg.get("predivide", 1.0),
            bucket_bytes=cfg["bucket"],
            algorithm=cfg.get("alg", "native"),
            comm=comm,
            overlap=cfg.get("overlap"),
        )
        passes, n = cfg.get("bpps", 1), comm.size
        x_all, y_all = data(STEPS * passes * n * B)
        for step in range(STEPS):
            opt.zero_grad()
            for j in range(passes):
                lo = ((step * passes + j) * n + comm.rank) * B
                loss = nn.functional.mse_loss(forward(model, cfg, x_all[lo : lo + B], comm.rank), y_all[lo : lo + B])
                (loss / passes).backward()
            opt.step()
        results.append([p.detach().clone().numpy() for p in model.parameters()])
        opt.remove_hooks()
    return results


def reference(cfg: dict, n: int) -> list[torch.Tensor]:
    """One process on the global batch (per-rank losses averaged where ranks run different code)."""
    model = make_model(cfg.get("model", "mlp"))
    opt = make_opt(cfg["opt"], model)
    passes = cfg.get("bpps", 1)
    x_all, y_all = data(STEPS * passes * n * B)
    scale = n if cfg.get("op") == "sum" else 1.0
    for step in range(STEPS):
        opt.zero_grad()
        lo, hi = step * passes * n * B, (step + 1) * passes * n * B
        if cfg.get("model") == "branchy":  # every pass of every rank: rank r's samples of pass j
            losses = [
                nn.functional.mse_loss(forward(model, cfg, x_all[c : c + B], r), y_all[c : c + B])
                for j in range(passes) for r in range(n) for c in [lo + (j * n + r) * B]
            ]
            loss = torch.stack(losses).mean()
        else:
            loss = nn.functional.mse_loss(model(x_all[lo:hi]), y_all[lo:hi])
        (loss * scale).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def check(results: list[list[list]], cfgs: list[dict], n: int) -> None:
    for i, cfg in enumerate(cfgs):
        ref = reference(cfg, n)
        tol = cfg.get("tol", 1e-5)
        for rank, per_rank in enumerate(results):
            for got, want in zip(per_rank[i], ref, strict=True):
                assert torch.allclose(torch.as_tensor(got), want, atol=tol, rtol=tol), (cfg, rank)
        # The reference moved, so a run that did nothing could not pass.
        start = next(make_model(cfg.get("model", "mlp")).parameters()).detach()
        assert not torch.allclose(ref[0], start)


def groups() -> dict[str, list[dict]]:
    every = configs()
    return {
        "sgd-every-algorithm": [c for c in every if "alg" in c and c["opt"] == "sgd"],
        "adam-every-algorithm": [c for c in every if "alg" in c and c["opt"] == "adam"],
        "passes-compression-ops-unused": [c for c in every if "alg" not in c],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("group", list(groups()))
def test_gloo_two_ranks_equal_one_process_on_the_global_batch(worlds, group):
    cfgs = groups()[group]
    check(worlds.spawn(train_distributed, 2, args=(cfgs,)), cfgs, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alg", algorithms())
def test_gloo_three_ranks(worlds, alg):
    cfgs = [{"opt": "sgd", "bucket": 256, "alg": alg}]
    if alg == "native":
        cfgs += [{"opt": "adam", "bucket": 1 << 22, "bpps": 2}, {"opt": "sgd", "bucket": 64, "model": "branchy"}]
    check(worlds.spawn(train_distributed, 3, args=(cfgs,)), cfgs, 3)


def mpi_main(out_dir: str) -> None:
    """Entry point under mpirun: train every configuration with the MPI communicator."""
    from ringpipe.comm import init_world

    torch.set_num_threads(1)
    comm = init_world("mpi")
    cfgs = [c for c in configs() if c.get("alg", "native") in ("native", "ring") and c.get("compression") != "bf16"]
    res = train_distributed(comm, cfgs)
    with open(os.path.join(out_dir, f"rank{comm.rank}.pkl"), "wb") as f:
        pickle.dump((cfgs, res), f)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_mpi_two_ranks_equal_one_process(mpi_jobs):
    out = mpi_jobs.run("dp_optimizer")  # its mpi entry point above on 2 ranks, writing into its folder
    loaded = [pickle.loads((out.folder / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    cfgs = loaded[0][0]
    check([res for _, res in loaded], cfgs, 2)


# ----------------------------------------------------------------------------- synchronize, clipping

MAX_NORM = 0.05


def _clipped(comm) -> list:
    """synchronize(), clip the averaged gradients, then step() inside skip_synchronize()."""
    model = make_model("mlp")
    opt = DistributedOptimizer(make_opt("sgd", model), model.named_parameters(), bucket_bytes=256, comm=comm)
    n = comm.size
    x_all, y_all = data(STEPS * n * B)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        lo = (step * n + comm.rank) * B
        nn.functional.mse_loss(model(x_all[lo : lo + B]), y_all[lo : lo + B]).backward()
        opt.synchronize()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with opt.skip_synchronize():
            opt.step()
    return [p.detach().clone().numpy() for p in model.parameters()], norms


@pytest.mark.timeout(60)
def test_clipping_after_synchronize_equals_one_process_with_clipping(worlds):
    results = worlds.spawn(_clipped, 2)
    model = make_model("mlp")
    opt = make_opt("sgd", model)
    x_all, y_all = data(STEPS * 2 * B)
    ref_norms = []
    for step in range(STEPS):
        opt.zero_grad()
        lo, hi = step * 2 * B, (step + 1) * 2 * B
        nn.functional.mse_loss(model(x_all[lo:hi]), y_all[lo:hi]).backward()
        ref_norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    assert min(ref_norms) > MAX_NORM  # clipping changed every step
    for params, norms in results:
        # the norm is that of the averaged gradient, so equal on every rank and to one process
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for got, want in zip(params, model.parameters(), strict=True):
            assert torch.allclose(torch.as_tensor(got), want.detach(), atol=1e-6)


# ----------------------------------------------------------------------------- overlap with backward

PAUSE_S = 0.3


class _Pause(torch.autograd.Function):
    """Identity whose backward records when it runs and takes PAUSE_S (releasing the GIL)."""

    marks: list[int] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Pause.marks.append(time.perf_counter_ns())
        time.sleep(PAUSE_S)
        _Pause.marks.append(time.perf_counter_ns())
        return grad


class _Halves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bottom = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.top = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.top(_Pause.apply(self.bottom(x)))


def _overlap(comm, policy="overlap"):
    from ringpipe.comm.events import default_log

    model = _Halves()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                               bucket_bytes=1, comm=comm, overlap=policy)  # one bucket per parameter
    x, y = data(B)
    log = default_log()
    log.clear()
    _Pause.marks.clear()
    nn.functional.mse_loss(model(x), y).backward()
    backward_end = time.perf_counter_ns()
    opt.step()
    # The first bucket rides in the step's announcement; later buckets are allreduces of their own size.
    sizes = {b.buffer.numel() * b.buffer.element_size() for b in opt.reducer.buckets[1:]}
    events = [e for e in log.events() if e.op == "allreduce" and e.comm == comm.name]
    first = [e.start_ns for e in events if e.nbytes == announcement_bytes(comm)]
    starts = sorted(first[:1] + [e.start_ns for e in events if e.nbytes in sizes])
    return len(opt.reducer.buckets), starts, _Pause.marks, backward_end


@pytest.mark.timeout(60)
def test_buckets_are_reduced_while_backward_runs(worlds):
    for buckets, starts, (pause_start, pause_end), backward_end in worlds.spawn(_overlap, 2):
        assert buckets == 8 and len(starts) == buckets
        # The top half's 4 buckets are reduced while backward is still in the pause between
        # the halves; the bottom half's gradients, and so their buckets, come after it.
        assert starts[0] < starts[3] < pause_end < starts[4]
        assert starts[3] < backward_end
        assert pause_end - pause_start >= PAUSE_S * 1e9


@pytest.mark.timeout(60)
def test_after_backward_holds_every_bucket_until_backward_ends(worlds, monkeypatch):
    monkeypatch.setenv("RINGPIPE_OVERLAP", "0")  # the environment's spelling of overlap=False
    for buckets, starts, _, backward_end in worlds.spawn(_overlap, 2, args=(None,)):
        assert buckets == 8 and len(starts) == buckets
        assert backward_end < starts[0], "a bucket went out before backward ended"


def _messages_per_step(comm, join_support, compression="none"):
    from ringpipe.comm.events import default_log

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), comm=comm,
                               join_support=join_support, compression=compression)
    x, y = data(B)
    counts = []
    for _ in range(3):
        default_log().clear()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        counts.append(sum(1 for e in default_log().events() if e.comm == comm.name and e.op == "allreduce"))
    return counts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("join_support", [True, False])
def test_a_one_bucket_step_is_one_allreduce_with_or_without_join_support(worlds, join_support, compression):
    """Join support costs no message of its own: the step's announcement carries the gradients
    (half-precision wires ride widened to float32)."""
    for counts in worlds.spawn(_messages_per_step, 2, args=(join_support, compression)):
        assert counts == [1, 1, 1]


def _compressed_gradients(comm, wire_name):
    """Each rank's averaged gradients after synchronize(), over two steps, and the plain formula's."""
    wire = {"fp16": torch.float16, "bf16": torch.bfloat16}[wire_name]

    def build():
        torch.manual_seed(0)  # the last layer's 160,400 gradients: more than ride in the announcement
        return nn.Sequential(nn.Linear(16, 400), nn.Tanh(), nn.Linear(400, 400))

    model = build()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                               compression=wire_name, first_bucket_bytes=600_000, comm=comm)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(comm.size, 4, 16, generator=g) for _ in range(2)]
    out = []
    for step, x in enumerate(xs):
        # the second step zeroes the gradients in place: backward accumulates into the bucket's views
        opt.zero_grad(set_to_none=step == 0)
        model(x[comm.rank]).square().mean().backward()
        opt.synchronize()
        got = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        # the plain formula: each rank's gradient divided by the size, cast to the wire, summed
        # there (one rounding of the exact sum of two values), cast back
        per_rank = []
        for r in range(comm.size):
            ref = build()
            ref(x[r]).square().mean().backward()
            per_rank.append([(p.grad / comm.size).to(wire).float() for p in ref.parameters()])
        want = [sum(gs).to(wire).float() for gs in zip(*per_rank, strict=True)]
        out.append((got, want))
    return len(opt.reducer.buckets), out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire_name", ["fp16", "bf16"])
def test_compressed_gradients_are_each_rank_s_cast_share_summed_on_the_wire(worlds, wire_name):
    for buckets, steps in worlds.spawn(_compressed_gradients, 2, args=(wire_name,)):
        assert buckets == 2
        for got, want in steps:
            for a, b in zip(got, want, strict=True):
                assert a.dtype == torch.float32 and torch.equal(a, b), (a - b).abs().max()
