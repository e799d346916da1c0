"""Horovod's documented semantics for ``horovod.torch``, on real processes: process sets, errors on
every rank, names in flight, scale factors on integers, and the gradients of the collectives.

Expected values are written here from Horovod's documentation and source (``horovod/torch/
mpi_ops.py``, ``horovod/common/process_sets.py``): the averaging allreduce of the gradient for
allgather and broadcast, the allgather scaled by the size for a Sum reduce-scatter, C++'s
truncation when an integer buffer is scaled.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ringpipe as hvd

HERE = Path(__file__).resolve().parents[2]  # tests/: the helper scripts and modules
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None


def _with_world(comm, fn, process_sets=None):  # noqa: ANN001
    hvd.init(comm, process_sets=process_sets)
    try:
        return fn()
    finally:
        hvd.shutdown()


def _raised(fn):  # noqa: ANN001
    """(error class names in the MRO that matter, text) of what ``fn`` raised, or ('', '')."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        kinds = {c.__name__ for c in type(exc).__mro__}
        return sorted(kinds & {"HorovodInternalError", "MismatchError", "InvalidCallError", "ValueError"}), str(exc)
    return [], ""


# ----------------------------------------------------------------------------- process sets


def _sets(comm):  # noqa: ANN001
    even = hvd.ProcessSet([0, 2])
    low = hvd.ProcessSet([1, 0])  # ranks are sorted, as in Horovod

    def body():
        r = hvd.rank()
        out = {
            "ids": (even.process_set_id, low.process_set_id, hvd.global_process_set.process_set_id),
            "ranks": (even.ranks, low.ranks, hvd.global_process_set.ranks),
            "size": even.size(), "included": (even.included(), low.included()),
            "rank_in_low": low.rank() if low.included() else _raised(low.rank),
            "basics": __import__("ringpipe.mpi_ops").mpi_ops._basics._get_process_set_ids_and_ranks(),
        }
        x = torch.tensor([float(r + 1)])
        if even.included():
            out["sum"] = float(hvd.allreduce(x, op=hvd.Sum, process_set=even))
            out["avg"] = float(hvd.allreduce(x, process_set=even))
            gathered = hvd.allgather(torch.full((r + 1, 2), float(r)), process_set=even)
            out["gather"] = gathered[:, 0].tolist()
            out["bcast"] = float(hvd.broadcast(x, root_rank=2, process_set=even))  # a world rank
            out["bad_root"] = _raised(lambda: hvd.broadcast(x, root_rank=1, process_set=even))
            out["objects"] = hvd.allgather_object(f"r{r}", process_set=even)
            out["object"] = hvd.broadcast_object({"from": r}, root_rank=2, process_set=even)
            hvd.barrier(process_set=even)
        else:
            out["foreign"] = _raised(lambda: hvd.allreduce(x, process_set=even))
        out["after"] = float(hvd.allreduce(x, op=hvd.Sum))  # the global set still works
        return out

    return _with_world(comm, body, process_sets=[even, low])


@pytest.mark.timeout(120)
def test_process_sets_run_collectives_among_their_ranks(worlds):
    out = worlds.spawn(_sets, 3)
    assert {o["ids"] for o in out} == {(1, 2, 0)}  # the same ids on every rank
    assert out[0]["ranks"] == ([0, 2], [0, 1], [0, 1, 2])
    # Horovod's internal table its own process-set tests read (``mpi_ops._basics``): {id: world ranks}
    assert [o["basics"] for o in out] == [{0: [0, 1, 2], 1: [0, 2], 2: [0, 1]}] * 3
    assert [o["included"] for o in out] == [(True, True), (False, True), (True, False)]
    assert [o["rank_in_low"] for o in out[:2]] == [0, 1]
    assert out[2]["rank_in_low"] == (["ValueError"], "Process is not part of provided process set.")
    for r in (0, 2):
        assert out[r]["sum"] == 1 + 3 and out[r]["avg"] == 2.0
        assert out[r]["gather"] == [0.0, 2.0, 2.0, 2.0]  # rank 0: one row of 0; rank 2: three rows of 2
        assert out[r]["bcast"] == 3.0
        kinds, text = out[r]["bad_root"]
        assert "InvalidCallError" in kinds and "root_rank 1 is not a rank of the process set" in text
        assert out[r]["objects"] == ["r0", "r2"] and out[r]["object"] == {"from": 2}
    kinds, text = out[1]["foreign"]
    assert "HorovodInternalError" in kinds and "Rank 1 is not a member of the provided process set" in text
    assert all(o["after"] == 6.0 for o in out)


def _static_duplicates(comm):  # noqa: ANN001
    size = comm.size
    dup = _raised(lambda: hvd.init(comm, process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet(range(1, size)),
                                                       hvd.ProcessSet(range(size - 1, -1, -1))]))
    initialized = hvd.is_initialized()
    again = _raised(lambda: hvd.init(comm, process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet([0])]))
    sets = [hvd.ProcessSet([0]), hvd.ProcessSet(reversed(range(1, size)))]  # the order of the ranks does not matter

    def body():
        total = None
        if sets[1].included():  # the set the refused init registered, reached through a new object
            total = float(hvd.allreduce(torch.ones(1) * comm.rank, op=hvd.Sum, process_set=sets[1]))
        unknown = _raised(lambda: hvd.init(comm, process_sets=[hvd.ProcessSet([0, 2])]))
        return [ps.process_set_id for ps in sets], sets[1].ranks, total, unknown

    return dup, initialized, again, _with_world(comm, body, process_sets=sets)


@pytest.mark.timeout(120)
def test_init_refuses_a_process_set_listed_twice_or_equal_to_the_global_one_as_horovod(worlds):
    for rank, (dup, initialized, again, (ids, ranks, total, unknown)) in enumerate(worlds.spawn(_static_duplicates, 3)):
        assert dup[0] == ["ValueError"] and "process_sets entry number 2 is a duplicate" in dup[1], dup
        assert again[0] == ["ValueError"] and "process_sets entry number 1 is a duplicate" in again[1], again
        # Horovod is initialised when it refuses the list, and init() again with a valid list goes on: each
        # listed set gets the id of the set with its ranks that the first init registered
        assert initialized
        assert ids == [1, 2] and ranks == [1, 2]
        assert total == (None if rank == 0 else 3.0)
        # only the first init registers sets
        assert unknown[0] == ["ValueError"] and "not a registered process set" in unknown[1], unknown


def _dynamic(comm):  # noqa: ANN001
    def body():
        out = {"static": _raised(lambda: hvd.add_process_set([0, 1]))}
        return out

    first = _with_world(comm, body)

    def body2():
        ps = hvd.add_process_set([0, 1])
        out = {"id": ps.process_set_id, "dup": _raised(lambda: hvd.add_process_set(hvd.ProcessSet([1, 0])))}
        if ps.included():
            out["sum"] = float(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps))
        out["removed"] = hvd.remove_process_set(ps)
        out["global_removed"] = hvd.remove_process_set(hvd.global_process_set)
        out["again"] = hvd.remove_process_set(ps)
        out["id_after"] = ps.process_set_id
        out["use_after"] = _raised(lambda: hvd.allreduce(torch.ones(1), process_set=ps))
        ps2 = hvd.add_process_set([1, 2])
        out["id2"] = ps2.process_set_id
        return out

    return first, _with_world(comm, body2, process_sets="dynamic")


@pytest.mark.timeout(120)
def test_dynamic_process_sets_as_in_horovod(worlds):
    out = worlds.spawn(_dynamic, 3)
    for first, second in out:
        kinds, text = first["static"]
        assert kinds == ["ValueError"] and "HOROVOD_DYNAMIC_PROCESS_SETS=1" in text
        assert second["id"] == 1 and second["id2"] == 2
        kinds, text = second["dup"]
        assert kinds == ["ValueError"] and "duplicate process set" in text
        assert second["removed"] is True and second["global_removed"] is False and second["again"] is False
        assert second["id_after"] is None
        kinds, text = second["use_after"]
        assert "ValueError" in kinds and "does not exist or has not been registered" in text
    assert [o[1].get("sum") for o in out] == [2.0, 2.0, None]


def _optimizer_on_set(comm):  # noqa: ANN001
    pair = hvd.ProcessSet([0, 1])

    def body():
        r = hvd.rank()
        w = torch.nn.Parameter(torch.zeros(3))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                       process_set=pair)
        (w * torch.tensor([1.0, 2.0, 3.0]) * (r + 1)).sum().backward()
        opt.step()
        model = torch.nn.Linear(2, 1)
        with torch.no_grad():
            model.weight.fill_(float(r))
        if pair.included():  # a non-member would get Horovod's "not a member" error
            hvd.broadcast_parameters(model.state_dict(), root_rank=1, process_set=pair)
        return w.detach().tolist(), float(model.weight[0, 0])

    return _with_world(comm, body, process_sets=[pair])


@pytest.mark.timeout(120)
def test_optimizer_and_parameter_broadcast_on_a_process_set(worlds):
    out = worlds.spawn(_optimizer_on_set, 3)
    grad = torch.tensor([1.0, 2.0, 3.0])
    members = (-(grad * 1 + grad * 2) / 2).tolist()  # SGD lr 1 on the average over ranks 0 and 1
    assert out[0][0] == members and out[1][0] == members
    assert out[2][0] == (-grad * 3).tolist()  # outside the set: its own gradient
    assert [o[1] for o in out] == [1.0, 1.0, 2.0]


# ----------------------------------------------------------------------------- errors on every rank


def _disagreements(comm):  # noqa: ANN001
    def body():
        r, last = hvd.rank(), hvd.rank() == hvd.size() - 1
        x = torch.ones(8)
        out = {
            "root": _raised(lambda: hvd.broadcast(x, root_rank=1 if last else 0)),
            "prescale": _raised(lambda: hvd.allreduce(x, prescale_factor=2.0 if last else 1.0)),
            "gather_dims": _raised(lambda: hvd.allgather(torch.ones(r + 1, 3 if last else 2))),
            "bcast_shape": _raised(lambda: hvd.broadcast(torch.ones(5 if last else 4), 0)),
        }
        h1 = hvd.allreduce_async(x, name="grad.w")
        out["name"] = _raised(lambda: hvd.synchronize(hvd.allreduce_async(x, name="grad.w")))
        out["first"] = float(hvd.synchronize(h1)[0])
        out["after"] = float(hvd.allreduce(torch.ones(1), op=hvd.Sum))
        return out

    return _with_world(comm, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_rank_raises_the_same_error_and_goes_on(worlds, nprocs):
    out = worlds.spawn(_disagreements, nprocs)
    for case, words in (("root", ["root ranks", "root_rank=1"]), ("prescale", ["prescale"]),
                        ("gather_dims", ["tensor shapes", "3"]), ("bcast_shape", ["tensor shapes", "[5]"])):
        texts = {o[case][1] for o in out}
        assert len(texts) == 1, (case, texts)  # the same text on every rank
        text = texts.pop()
        for o in out:
            assert "HorovodInternalError" in o[case][0] and "MismatchError" in o[case][0], (case, o[case])
        assert f"rank {nprocs - 1}" in text and "rank 0" in text, text
        for w in words:
            assert w in text, (case, w, text)
    for o in out:
        kinds, text = o["name"]
        # Horovod: a name still in flight is refused at once, on the rank that posted it, as ValueError
        assert kinds == ["ValueError"] and "'grad.w' is still in flight" in text, o["name"]
        assert o["first"] == 1.0 and o["after"] == float(nprocs)


def _named_out_of_order(comm):  # noqa: ANN001
    """Horovod's duplicate-name pattern: rank 0 posts a named allreduce and waits in a barrier that
    the others reach first; their allreduce of that name comes after the barrier."""
    def body():
        r = hvd.rank()
        x = torch.full((3,), float(r + 1))
        out = {}
        handle = None
        if r == 0:
            handle = hvd.allreduce_async(x, name="late", op=hvd.Sum)
            out["dup0"] = _raised(lambda: hvd.allreduce_async(x, name="late"))
        hvd.barrier()
        if r > 0:  # rank 0's is waiting for it: this one may complete at once, so no second post here
            handle = hvd.allreduce_async(x, name="late", op=hvd.Sum)
        hvd.barrier()
        out["sum"] = hvd.synchronize(handle).tolist()
        # two named operations posted in opposite orders on the two halves of the ranks
        a, b = torch.full((2,), float(r)), torch.full((4,), 10.0 * r)
        if r % 2 == 0:
            ha, hb = hvd.allreduce_async(a, name="a", op=hvd.Sum), hvd.allgather_async(b, name="b")
        else:
            hb, ha = hvd.allgather_async(b, name="b"), hvd.allreduce_async(a, name="a", op=hvd.Sum)
        out["a"], out["b"] = hvd.synchronize(ha).tolist(), hvd.synchronize(hb).tolist()
        out["after"] = float(hvd.allreduce(torch.ones(1), op=hvd.Sum))
        return out

    return _with_world(comm, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_named_operations_match_by_name_whatever_order_the_ranks_posted_them_in(worlds, nprocs):
    out = worlds.spawn(_named_out_of_order, nprocs)
    total = float(sum(range(1, nprocs + 1)))
    dup = out[0]["dup0"]  # refused on rank 0 alone, where it was posted; nothing was posted
    assert dup[0] == ["ValueError"] and "'late' is still in flight" in dup[1], dup
    for o in out:
        assert o["sum"] == [total] * 3
        assert o["a"] == [float(sum(range(nprocs)))] * 2
        assert o["b"] == [10.0 * k for k in range(nprocs) for _ in range(4)]
        assert o["after"] == float(nprocs)


# ----------------------------------------------------------------------------- numbers


def _integers(comm):  # noqa: ANN001
    def body():
        r = hvd.rank()
        x = torch.tensor([3, -3, 7], dtype=torch.int32) * (r + 1)
        s = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.5)
        return s.dtype, s.tolist()

    return _with_world(comm, body)


def test_scale_factors_on_integers_truncate_as_horovod(worlds):
    out = worlds.spawn(_integers, 2)
    # each rank scales its int32 buffer by 0.5 (C++ truncation toward zero), the sum is scaled by 1.5
    pre = [[int(v * 0.5) for v in (3 * k, -3 * k, 7 * k)] for k in (1, 2)]
    summed = [a + b for a, b in zip(*pre, strict=True)]
    want = [int(v * 1.5) for v in summed]
    assert out == [(torch.int32, want)] * 2


def _integer_averages(comm):  # noqa: ANN001
    def body():
        r = hvd.rank()
        base = [[-7, 5, -1, 9, -100, 3], [2, -8, 0, 0, 1, 4], [-3, 0, -2, 1, 33, -6]][r]
        out = {}
        for dtype in (torch.int32, torch.int64):
            x = torch.tensor(base, dtype=dtype)
            out[f"allreduce {dtype}"] = hvd.allreduce(x, op=hvd.Average).tolist()
            out[f"allreduce_ {dtype}"] = hvd.allreduce_(x.clone(), average=True).tolist()
            out[f"async {dtype}"] = hvd.synchronize(hvd.allreduce_async(x, op=hvd.Average)).tolist()
            out[f"grouped {dtype}"] = [t.tolist() for t in hvd.grouped_allreduce([x[:2], x[2:]], op=hvd.Average)]
            out[f"postscale {dtype}"] = hvd.allreduce(x, op=hvd.Average, postscale_factor=2.5).tolist()
            out[f"reducescatter {dtype}"] = hvd.reducescatter(x, op=hvd.Average).tolist()
        return out

    return _with_world(comm, body)


def test_integer_averages_truncate_toward_zero_as_horovod(worlds):
    """Horovod averages by scaling the sum by postscale / size in double precision and converting
    back to the integer type (``operations.cc``: ``postscale_factor /= size``; ``ScaleBuffer``),
    which truncates toward zero: -7 + 2 - 3 = -8 over 3 ranks is -2, not floor's -3."""
    ranks = [[-7, 5, -1, 9, -100, 3], [2, -8, 0, 0, 1, 4], [-3, 0, -2, 1, 33, -6]]
    sums = [sum(col) for col in zip(*ranks, strict=True)]
    avg = [int(s * (1.0 / 3)) for s in sums]  # C++'s double-to-int conversion truncates
    post = [int(s * (2.5 / 3)) for s in sums]
    assert avg == [-2, -1, -1, 3, -22, 0] and post[0] == -6  # the cases that floor would get wrong
    outs = worlds.spawn(_integer_averages, 3)
    for rank, out in enumerate(outs):
        for dtype in (torch.int32, torch.int64):
            assert out[f"allreduce {dtype}"] == avg
            assert out[f"allreduce_ {dtype}"] == avg
            assert out[f"async {dtype}"] == avg
            assert out[f"grouped {dtype}"] == [avg[:2], avg[2:]]
            assert out[f"postscale {dtype}"] == post
            assert out[f"reducescatter {dtype}"] == avg[2 * rank : 2 * rank + 2]


def _gradients(comm):  # noqa: ANN001
    def body():
        r, n = hvd.rank(), hvd.size()
        c = torch.arange(1.0, 1.0 + 2 * (0 + 1 + 2)).reshape(-1, 2)[: sum(range(1, n + 1))]
        x = torch.full((r + 1, 2), float(r), requires_grad=True)
        (hvd.allgather(x) * c).sum().backward()
        grads = {"allgather": x.grad.tolist()}
        b = torch.ones(3, requires_grad=True)
        (hvd.broadcast(b, root_rank=1) * torch.tensor([1.0, 2.0, 3.0]) * (r + 1)).sum().backward()
        grads["broadcast"] = b.grad.tolist()
        for op in (hvd.Sum, hvd.Average):
            z = torch.ones(2 * n, requires_grad=True)
            (hvd.reducescatter(z, op=op) * torch.tensor([1.0, 2.0]) * (r + 1)).sum().backward()
            grads[f"reducescatter_{op.value}"] = z.grad.tolist()
        return grads

    return _with_world(comm, body)


@pytest.mark.timeout(120)
def test_gradients_follow_horovods_conventions(worlds):
    n = 2
    out = worlds.spawn(_gradients, n)
    c = torch.arange(1.0, 13.0).reshape(-1, 2)[:3]
    # allgather: the output gradient c (the same everywhere) averaged, then this rank's rows
    assert out[0]["allgather"] == c[:1].tolist() and out[1]["allgather"] == c[1:3].tolist()
    # broadcast: the average over ranks of the output gradients on the root, zero elsewhere
    mean = (torch.tensor([1.0, 2.0, 3.0]) * (1 + 2) / 2).tolist()
    assert out[1]["broadcast"] == mean and out[0]["broadcast"] == [0.0, 0.0, 0.0]
    # reduce-scatter: the allgather of every rank's output gradient, times the size for Sum
    g = [1.0, 2.0, 2.0, 4.0]  # rank 0's block gradient [1, 2], rank 1's [2, 4]
    assert all(o["reducescatter_sum"] == [v * n for v in g] for o in out)
    assert all(o["reducescatter_average"] == g for o in out)


# ----------------------------------------------------------------------------- small differences


def _small(comm):  # noqa: ANN001
    def body():
        out = {"ccl": hvd.ccl_built(), "internal": issubclass(hvd.HorovodInternalError, RuntimeError),
               # Horovod's gpu_available(ext_base_name): False for a framework without a GPU or not served
               "gpu": [hvd.gpu_available("torch") == torch.cuda.is_available(), hvd.gpu_available("mxnet")]}
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # no .grad and no state yet
        out["state"] = sorted(next(iter(opt.state.values())).keys())
        dopt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
        model(torch.ones(1, 3)).sum().backward()
        dopt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dopt.step()
        out["warned"] = any("skip_synchronize" in str(w.message) for w in caught)
        return out

    first = _with_world(comm, body)
    again = _with_world(comm, lambda: hvd.size())  # init after shutdown
    return first, again


def test_small_horovod_behaviours(worlds):
    out = worlds.spawn(_small, 2)
    for first, again in out:
        assert first["ccl"] is False and first["internal"] is True and first["gpu"] == [True, False]
        assert first["state"] == ["exp_avg", "exp_avg_sq", "step"]
        assert first["warned"] is True
        assert again == 2


# ----------------------------------------------------------------------------- Adasum


def _adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Maleki et al. (MLSys 2021): (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b, in float64."""
    a, b = a.double(), b.double()
    dot = float((a * b).sum())
    return (1 - dot / (2 * float((a * a).sum()))) * a + (1 - dot / (2 * float((b * b).sum()))) * b


def _adasum_api(comm):  # noqa: ANN001
    def body():
        r = hvd.rank()
        g = torch.tensor([1.0, 2.0, -1.0]) * (r + 1) + torch.tensor([0.5, -3.0, 2.0]) * r
        out = {"allreduce": hvd.allreduce(g, op=hvd.Adasum).tolist()}
        h = torch.tensor([3.0, -1.0]) * (1 - 2 * r)
        out["grouped"] = [t.tolist() for t in hvd.grouped_allreduce_([g.clone(), h.clone()], op=hvd.Adasum)]
        w = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.5), named_parameters=[("w", w)], op=hvd.Adasum)
        (w * g).sum().backward()
        opt.step()
        out["optimizer"] = w.detach().tolist()
        return out

    return _with_world(comm, body)


@pytest.mark.timeout(120)
def test_adasum_through_the_api_and_the_optimizer(worlds):
    out = worlds.spawn(_adasum_api, 2)
    g = [torch.tensor([1.0, 2.0, -1.0]) * (r + 1) + torch.tensor([0.5, -3.0, 2.0]) * r for r in range(2)]
    h = [torch.tensor([3.0, -1.0]) * (1 - 2 * r) for r in range(2)]
    want = _adasum_pair(g[0], g[1])
    for o in out:
        assert torch.allclose(torch.tensor(o["allreduce"]).double(), want, atol=1e-5)
        # grouped: every tensor combined with its own dot products
        assert torch.allclose(torch.tensor(o["grouped"][0]).double(), want, atol=1e-5)
        assert torch.allclose(torch.tensor(o["grouped"][1]).double(), _adasum_pair(h[0], h[1]), atol=1e-5)
        # Horovod's delta optimizer: each rank's SGD update -lr * g_r, combined by Adasum, added to the start
        step = _adasum_pair(-0.5 * g[0], -0.5 * g[1])
        assert torch.allclose(torch.tensor(o["optimizer"]).double(), 1.0 + step, atol=1e-5)


# ----------------------------------------------------------------------------- every dtype


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_dtype_through_the_collectives_on_sets_over_gloo(worlds, nprocs):
    from scripts.hvd_dtypes import check

    assert worlds.spawn(check, nprocs) == [[]] * nprocs


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_every_dtype_through_the_collectives_on_sets_over_mpi(mpi_jobs):
    out = mpi_jobs.run("hvd_dtypes")  # scripts/hvd_dtypes.py on 3 ranks, CASES_DIR its folder
    assert [json.loads((out.folder / f"rank{r}.json").read_text()) for r in range(3)] == [[]] * 3


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_init_on_an_mpi4py_communicator_as_horovod(mpi_jobs):
    """Horovod's ``init(comm=...)`` with an mpi4py communicator (its docs' mpi4py example): the world
    is the communicator's members, local and cross ranks among them; process sets may be mpi4py
    communicators too; a gloo backend with an MPI communicator is refused on every rank."""
    out = mpi_jobs.run("hvd_mpi_comm")  # scripts/hvd_mpi_comm.py FOLDER on 3 ranks
    got = [json.loads((out.folder / f"rank{r}.json").read_text()) for r in range(3)]
    parts = {0: [0, 2], 1: [1], 2: [0, 2]}  # world rank -> the world ranks of its part (Split by parity)
    for w, o in enumerate(got):
        members = parts[w]
        assert o["rank"] == members.index(w) and o["size"] == len(members)
        assert o["local"] == [members.index(w), len(members), 0, 1]  # one host
        assert o["sum"] == [float(sum(members))]
        assert o["gather"] == members and o["bcast"] == members[0]
        assert o["again"] == [w, 3, [3.0]]
        assert o["sets"] == [[0, 1, 2], [0, 2], [1]]  # the global set and both parts, known on every rank
        assert "mpi backend" in o["gloo"]
