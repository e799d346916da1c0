"""Pipeline throughput: ringpipe gpipe/1f1b/async_1f1b against torch.distributed.pipelining, 2 stages.

Same model (an MLP of ``--layers`` Linear+ReLU blocks), same split (half the blocks per
stage), same batch and micro-batches, both over gloo in the same run (2 processes, one thread
each). Also reports ringpipe's peak activation memory per stage with and without
recomputation: the bytes autograd saves for backward plus the stage inputs kept for
recomputation, summed over the micro-batches in flight (CPU has no allocator statistics).

    python benchmarks/pipeline_vs_torch.py --steps 30 --microbatches 4
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.distributed as dist
from torch import nn

from ringpipe.launch import spawn
from ringpipe.pipeline import PipelineTrainer

__all__ = ["main"]


def make_layers(width: int, layers: int) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(layers):
        out += [nn.Linear(width, width), nn.ReLU()]
    out.append(nn.Linear(width, 10))
    return out


def data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)


class ActivationMeter:
    """Live bytes of tensors saved for backward (a saved-tensors hook) plus kept stage inputs.

    The peak is taken whenever a tensor is saved, so the forward replayed inside a recomputed
    backward counts too (its graph lives until that backward ends).
    """

    def __init__(self, trainer: PipelineTrainer) -> None:
        self.live = 0
        self.kept = 0
        self.peak = 0
        self.rt = trainer.runtime
        meter = self

        class Held:
            __slots__ = ("t", "n")

            def __init__(self, t: torch.Tensor) -> None:
                self.t, self.n = t, t.numel() * t.element_size()
                meter.live += self.n
                meter.peak = max(meter.peak, meter.live + meter.kept)

            def __del__(self) -> None:
                meter.live -= self.n

        self.hooks = torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t)

        def tracked(orig):  # type: ignore[no-untyped-def]
            def call(*a, **k):  # type: ignore[no-untyped-def]
                out = orig(*a, **k)
                if self.rt.recompute:
                    self.kept = sum(t.numel() * t.element_size() for r in self.rt._records.values() for t in r.inputs)
                self.peak = max(self.peak, self.live + self.kept)
                return out
            return call

        self.rt.forward = tracked(self.rt.forward)  # type: ignore[method-assign]
        self.rt.backward = tracked(self.rt.backward)  # type: ignore[method-assign]


def ringpipe_run(comm, args, schedule: str, recompute: bool = False) -> dict:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    is_async = schedule == "async"
    t = PipelineTrainer(
        comm, make_layers(args.width, args.layers), balance=[args.layers, args.layers + 1],
        schedule=schedule, microbatches=args.microbatches,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01),
        loss_fn=nn.functional.cross_entropy, recompute=recompute,
        step_every=args.microbatches if is_async else 1,
    )
    x, y = data(args)
    feed = (x if t.is_first else None, y if t.is_last else None)
    meter = ActivationMeter(t)
    with meter.hooks:
        for _ in range(args.warmup):
            t.train_step(*feed)
        comm.barrier()
        t0 = time.perf_counter()
        if is_async:
            t.train_stream((feed for _ in range(args.steps)), args.steps)
        else:
            for _ in range(args.steps):
                t.train_step(*feed)
        comm.barrier()
        dt = time.perf_counter() - t0
    res = {"samples_per_s": args.steps * args.batch / dt}
    if not is_async:  # the async stage keeps its graphs under its own saved-tensor hooks
        res["peak_act_mib"] = meter.peak / 2**20
    return res


def torch_run(comm, args, schedule: str) -> dict:  # type: ignore[no-untyped-def]
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    layers = make_layers(args.width, args.layers)
    mine = nn.Sequential(*(layers[: 2 * args.layers] if comm.rank == 0 else layers[2 * args.layers :]))
    stage = PipelineStage(mine, comm.rank, 2, torch.device("cpu"), group=dist.group.WORLD)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, args.microbatches, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD(mine.parameters(), lr=0.01)
    x, y = data(args)

    def step() -> None:
        opt.zero_grad()
        if comm.rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()

    for _ in range(args.warmup):
        step()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    comm.barrier()
    return {"samples_per_s": args.steps * args.batch / (time.perf_counter() - t0)}


def worker(comm, args) -> dict:  # type: ignore[no-untyped-def]
    out: dict = {}
    for rep in range(args.repeats):
        for name, fn in [
            ("torch gpipe", lambda: torch_run(comm, args, "gpipe")),
            ("ringpipe gpipe", lambda: ringpipe_run(comm, args, "gpipe")),
            ("torch 1f1b", lambda: torch_run(comm, args, "1f1b")),
            ("ringpipe 1f1b", lambda: ringpipe_run(comm, args, "1f1b")),
            ("ringpipe async_1f1b", lambda: ringpipe_run(comm, args, "async")),
            ("ringpipe gpipe+recompute", lambda: ringpipe_run(comm, args, "gpipe", True)),
            ("ringpipe 1f1b+recompute", lambda: ringpipe_run(comm, args, "1f1b", True)),
        ]:
            res = fn()
            prev = out.get(name)
            # best of the repeats for throughput (the machine is shared); memory is deterministic
            if prev is None or res["samples_per_s"] > prev["samples_per_s"]:
                out[name] = res
        del rep
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4, help="Linear+ReLU blocks per stage")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = spawn(worker, 2, args=(args,), env={"OMP_NUM_THREADS": "1"})
    if args.json:
        print(json.dumps(results))
        return
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, gloo, 2 processes x 1 thread")
    print(f"# MLP width {args.width}, {args.layers}+{args.layers + 1} layers per stage, batch {args.batch}, "
          f"{args.microbatches} micro-batches, {args.steps} steps (best of {args.repeats})")
    base = {s: results[0][f"torch {s}"]["samples_per_s"] for s in ("gpipe", "1f1b")}
    print("| run | samples/s | vs torch same schedule | peak act. MiB stage 0 / 1 |")
    print("| --- | --- | --- | --- |")
    for name, r0 in results[0].items():
        ref = base.get(name.split()[1].split("+")[0]) if name.startswith("ringpipe") else None
        ratio = f"{r0['samples_per_s'] / ref:.2f}x" if ref and "async" not in name else ""
        if "async" in name:
            ratio = (f"{r0['samples_per_s'] / results[0]['ringpipe 1f1b']['samples_per_s']:.2f}x ringpipe 1f1b, "
                     f"{r0['samples_per_s'] / results[0]['ringpipe gpipe']['samples_per_s']:.2f}x ringpipe gpipe")
        mem = f"{r0['peak_act_mib']:.2f} / {results[1][name]['peak_act_mib']:.2f}" if "peak_act_mib" in r0 else ""
        print(f"| {name} | {r0['samples_per_s']:.0f} | {ratio} | {mem} |")


if __name__ == "__main__":
    main()
