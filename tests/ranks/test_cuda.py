"""GPU paths: NCCL communicator, CUDA tensors over gloo, DistributedOptimizer on CUDA (skipped without a GPU)."""

import copy

import pytest
import torch

from ringpipe.comm import ReduceOp
from ringpipe.launch import spawn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _nccl_ops(comm):
    dev = torch.device("cuda", comm.topology.local_rank)
    assert comm.device == dev
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        for op in (o for o in ReduceOp if o is not ReduceOp.ADASUM):  # adasum: ringpipe.collectives
            t = (torch.arange(6, device=dev) + 1).to(dtype)
            comm.allreduce(t, op)
            out[f"allreduce-{op.value}-{dtype}"] = t.cpu().double().tolist()
        t = torch.arange(4, device=dev, dtype=dtype)
        comm.broadcast(t, 0)
        out[f"broadcast-{dtype}"] = t.cpu().double().tolist()
        out[f"allgather-{dtype}"] = [x.cpu().double().tolist() for x in comm.allgather(torch.ones(2, device=dev, dtype=dtype))]
    w = comm.iallreduce(torch.ones(3, device=dev), "average")
    out["iallreduce"] = w.wait().cpu().tolist()
    out["reduce_scatter"] = comm.reduce_scatter(torch.ones(4, device=dev) * 2, "sum").cpu().tolist()
    out["object"] = comm.broadcast_object({"a": 1}, 0)
    comm.barrier()
    cpu = torch.ones(2, dtype=torch.int64)
    comm.allreduce(cpu, "sum")  # a CPU tensor in an NCCL job travels over gloo, as in Horovod
    out["cpu"] = (cpu.device.type, cpu.tolist())
    return out


def test_nccl_single_rank_every_operation():
    (out,) = spawn(_nccl_ops, 1, backend="nccl")
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        for op in (o for o in ReduceOp if o is not ReduceOp.ADASUM):  # adasum: ringpipe.collectives
            exp = [float(i + 1) for i in range(6)]
            if op is ReduceOp.AVERAGE and dtype == torch.int64:
                exp = exp  # one rank: the average is the value itself
            assert out[f"allreduce-{op.value}-{dtype}"] == exp
        assert out[f"broadcast-{dtype}"] == [0.0, 1.0, 2.0, 3.0]
        assert out[f"allgather-{dtype}"] == [[1.0, 1.0]]
    assert out["iallreduce"] == [1.0, 1.0, 1.0]
    assert out["reduce_scatter"] == [2.0, 2.0, 2.0, 2.0]
    assert out["object"] == {"a": 1}
    assert out["cpu"] == ("cpu", [1, 1])


def _gloo_cuda(comm):
    t = torch.full((5,), float(comm.rank + 1), device="cuda")
    comm.allreduce(t, "sum")
    b = torch.full((3,), float(comm.rank), device="cuda")
    comm.broadcast(b, 1)
    return t.cpu().tolist(), b.cpu().tolist()


def test_gloo_with_cuda_tensors_two_ranks():
    res = spawn(_gloo_cuda, 2, backend="gloo")
    for t, b in res:
        assert t == [3.0] * 5
        assert b == [1.0] * 3


def _dp_cuda(comm, steps):
    import ringpipe as hvd

    hvd.init(comm=comm)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).cuda()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g).cuda()
        y = torch.randint(0, 2, (4,), generator=g).cuda()
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    metric = hvd.allreduce(torch.tensor(2.0), name="metric")  # Horovod's metric_average: a CPU tensor
    assert metric.device.type == "cpu" and metric.item() == 2.0, metric
    hvd.shutdown()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def test_distributed_optimizer_on_nccl_equals_plain_training():
    (diff,) = spawn(_dp_cuda, 1, backend="nccl", args=(3,))
    assert diff < 1e-6


def test_default_backend_is_nccl_only_where_every_local_rank_has_a_gpu():
    from ringpipe.comm.rendezvous import default_backend

    gpus = torch.cuda.device_count()
    assert default_backend(gpus) == "nccl"
    assert default_backend(gpus + 1) == "gloo"  # NCCL refuses two ranks on one GPU


def _stage_memory_on_cuda(comm):
    from ringpipe.pipeline import PipelineTrainer
    from ringpipe.pipeline.memory import MemoryMeter

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                 torch.nn.ReLU(), torch.nn.Linear(256, 10))
    t = PipelineTrainer(comm, layers, balance=[5], schedule="1f1b", microbatches=4,
                        optimizer_factory=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                        loss_fn=torch.nn.functional.cross_entropy)
    meter = MemoryMeter().attach(t.runtimes, t.executor, t.optimizer, t.policy)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        t.train_step(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
    return t.device.type, meter.peak.as_dict()


def test_a_stages_measured_memory_includes_the_gpu_allocators_peak():
    """On a GPU the meter also reports ``torch.cuda.max_memory_allocated``: at least the tensors the stage holds
    at its sampled peak (the allocator counts those, rounded up to its blocks, and its temporaries besides)."""
    ((device, peak),) = spawn(_stage_memory_on_cuda, 1, backend="nccl")
    assert device == "cuda"
    assert peak["gpu_peak"] >= peak["peak"] > 0, peak


def _actions_timed_on_cuda(comm):
    from ringpipe.comm.events import EventLog
    from ringpipe.pipeline import PipelineTrainer
    from ringpipe.pipeline.action_events import computes_on_cpu, record_actions

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    t = PipelineTrainer(comm, layers, balance=[3], schedule="1f1b", microbatches=4,
                        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1),
                        loss_fn=torch.nn.functional.cross_entropy)
    log = EventLog()
    record_actions(log, t.runtimes, t.executor, schedule=t.schedule, stage=t.stage, stages=1, microbatches=4,
                   chunks=1, balance=[3], recompute=False, step_every=1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        t.train_step(torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g))
    events = log.events()
    return [(e.op, e.detail.get("gpu_ns")) for e in events], computes_on_cpu(events)


def test_a_gpu_stages_actions_carry_their_kernels_time_and_need_no_core():
    ((timed, on_cpu),) = spawn(_actions_timed_on_cuda, 1, backend="nccl")
    assert {op for op, _ in timed} == {"pipeline.F", "pipeline.B", "pipeline.S"}
    assert all(ns is not None and ns > 0 for _, ns in timed), timed
    assert not on_cpu
