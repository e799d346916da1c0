"""Bad input to the data-parallel layer gets an error naming what is wrong and the fix (real processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringpipe.dp import Compression, DistributedOptimizer


def _catch(fn):
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _errors(comm):
    out = {}
    model = nn.Linear(3, 2)
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    out["predivide"] = _catch(lambda: DistributedOptimizer(sgd(), op="sum", gradient_predivide_factor=2.0, comm=comm))
    out["op"] = _catch(lambda: DistributedOptimizer(sgd(), op="max", comm=comm))
    out["algorithm"] = _catch(lambda: DistributedOptimizer(sgd(), algorithm="carrier-pigeon", comm=comm))
    out["passes"] = _catch(lambda: DistributedOptimizer(sgd(), backward_passes_per_step=0, comm=comm))
    out["overlap"] = _catch(lambda: DistributedOptimizer(sgd(), overlap="sometimes", comm=comm))

    # Ranks that built different models are told so at construction (on every rank, no hang).
    other = nn.Linear(3, 2 + comm.rank)
    out["mismatch"] = _catch(lambda: DistributedOptimizer(
        torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters(), comm=comm))

    # A gradient computed more often than backward_passes_per_step before step().
    opt = DistributedOptimizer(sgd(), model.named_parameters(), backward_passes_per_step=1, comm=comm)
    assert opt.backward_passes_per_step == 1

    def twice():
        model(torch.ones(1, 3)).sum().backward()
        model(torch.ones(1, 3)).sum().backward()

    out["twice"] = _catch(twice)
    return out


@pytest.mark.timeout(60)
def test_errors_name_the_problem_and_the_fix(worlds):
    for out in worlds.spawn(_errors, 2):
        assert "only applies with op=Average" in out["predivide"] and "gradient_predivide_factor=2.0" in out["predivide"]
        assert "Average or Sum" in out["op"]
        assert "'carrier-pigeon'" in out["algorithm"] and "valid: native" in out["algorithm"]
        assert "backward_passes_per_step must be an integer >= 1" in out["passes"]
        assert "overlap='sometimes' is not a launch policy" in out["overlap"], out["overlap"]
        assert "overlap, after_backward" in out["overlap"]
        assert "parameter mismatch across ranks" in out["mismatch"] and "rank 1" in out["mismatch"]
        assert "(2, 3)" in out["mismatch"] and "(3, 3)" in out["mismatch"]
        assert "'weight' was computed 2 times before step()" in out["twice"] or "'bias'" in out["twice"]
        assert "backward_passes_per_step=1" in out["twice"]


def test_single_process_errors():
    with pytest.raises(ValueError, match="unknown compression 'zip'; valid: none, fp16, bf16"):
        Compression.parse("zip")
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        DistributedOptimizer(object())  # type: ignore[arg-type]
    assert Compression.fp16.compress(torch.ones(2))[0].dtype == torch.float16
    assert Compression.fp16.compress(torch.ones(2, dtype=torch.int64))[0].dtype == torch.int64


# Per setting: the value on rank 0 and on rank 1 (the algorithm "carrier-pigeon" is invalid: the
# mismatch is still reported on every rank instead of rank 1 alone raising and rank 0 hanging).
DIFFERENT = {
    "bucket_bytes": (1024, 2048),
    "first_bucket_bytes": (256, 512),
    "compression": ("none", "fp16"),
    "algorithm": ("native", "carrier-pigeon"),
    "backward_passes_per_step": (1, 2),
    "op": ("average", "sum"),
    "gradient_predivide_factor": (1.0, 2.0),
    "overlap": (None, "sometimes"),  # rank 0 the default, rank 1 an unknown launch policy
}
SHOWN = {"compression": ("none", "fp16"), "op": ("average", "sum"), "overlap": ("overlap", "sometimes")}


def _different_settings(comm):
    out = {}
    for setting, values in DIFFERENT.items():
        model = nn.Linear(3, 2)
        out[setting] = _catch(lambda m=model, kw={setting: values[comm.rank]}: DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), comm=comm, **kw))
    # still usable afterwards: equal settings build an optimizer on every rank
    model = nn.Linear(3, 2)
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=64, comm=comm)
    return out


@pytest.mark.timeout(60)
def test_settings_that_differ_across_ranks_are_an_error_on_every_rank(worlds):
    for out in worlds.spawn(_different_settings, 2):
        for setting, (a, b) in DIFFERENT.items():
            msg = out[setting]
            assert msg is not None and msg.startswith("ValueError"), (setting, msg)
            a, b = SHOWN.get(setting, (a, b))
            assert f"{setting} differs across ranks" in msg, msg
            assert f"rank 0: {a!r}" in msg and f"rank 1: {b!r}" in msg, msg


def _step_against_allreduce(comm, features=4):
    """The last rank allreduces; the others step (their first gradients ride in the step's announcement,
    the rest of a bucket longer than that goes out right behind it)."""
    from ringpipe.comm.base import ReduceOp
    from ringpipe.core.ops import allreduce_inplace

    model = nn.Linear(features, 100 if features > 4 else 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), comm=comm)
    out = {}
    for _ in range(3):  # agreed steps first: their header is remembered, a different one must still be read
        model(torch.ones(3, features)).sum().backward()
        opt.step()
        opt.zero_grad()

    def call():
        if comm.rank < comm.size - 1:
            model(torch.ones(3, features)).sum().backward()
            opt.step()
        else:
            allreduce_inplace(comm, torch.ones(3), ReduceOp.SUM)

    out["first"] = _catch(call)
    # the communicator is still usable afterwards: nothing is left in flight
    t = torch.ones(2) * (comm.rank + 1)
    comm.allreduce(t)
    out["after"] = t.tolist()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("features", [4, 1400])  # 1400: 140,100 gradients, more than ride in the announcement
@pytest.mark.parametrize("ranks", [2, 3])  # 2: the messages go as pairwise exchanges on gloo
def test_an_optimizer_step_against_another_collective_is_an_error_on_every_rank(worlds, features, ranks):
    for out in worlds.spawn(_step_against_allreduce, ranks, args=(features,)):
        msg = out["first"]
        assert msg is not None and "collective=step" in msg and "collective=allreduce" in msg, msg
        total = float(sum(range(1, ranks + 1)))
        assert out["after"] == [total, total]  # nothing of the abandoned step is left in flight
