"""A Hugging Face GPT-2 pipelined on 2 ranks: ringpipe's schedules against torch.distributed.pipelining.

Both systems get the same model — a ``GPT2LMHeadModel`` built from one ``GPT2Config`` with one seed
(random weights, nothing downloaded; ``use_cache=False``; dropout off so both sides compute the
same thing) — and the same split: a new stage begins at ``transformer.h.{layers // 2}``
(``--split``). torch's side is ``torch.distributed.pipelining.pipeline(model, mb_args,
split_spec={name: SplitPoint.BEGINNING})`` with ``ScheduleGPipe`` / ``Schedule1F1B``; ringpipe's
is ``PipelineTrainer(comm, model, split_points=[name], sample=...)`` with its synchronous schedules
and the asynchronous 1F1B (``stream_step``: the pipeline stays full across batches, one optimizer
step per batch, ``step_every = micro-batches``). Same data (random token ids; the target of a token
is the next id modulo the vocabulary, a task the loss can fall on), batch, micro-batches, SGD, loss
(token cross-entropy on the logits), one thread per process, warm-up.

GPT-2's LM head is its token embedding: split, stage 0 holds the embedding and stage 1 the head.
ringpipe's synchronous schedules sum the two copies' gradients before every step (one small
allreduce per step: the tied weights stay equal, as in one process); its asynchronous pipeline lets
stage 0 own the weight and stage 1 keep a mirror one step late (point-to-point messages, the stream
stays open; docs/pipelines.md, "Tied weights"); torch.distributed.pipelining keeps two untied copies,
so its stage 1 trains a different model. The comparison is therefore ringpipe doing a little more work.

The variants run in blocks (each variant once per block, built afresh, the order rotated from block
to block) so that drift of a shared machine falls on all of them; reported: samples/s median and
spread over blocks, ratios as medians of per-block ratios, and each rank's peak memory: parameters
and gradients it holds plus the live bytes of the storages autograd saves for backward (a
saved-tensors hook, each storage counted once, a parameter's not at all; ringpipe's asynchronous
stages are hooked through their own weight-stash hooks). The asynchronous pipeline's accuracy
figure: the mean training loss of the last quarter of the timed steps, and the loss on a held-out
batch after all the steps (warm-up and timed, the stream drained; ringpipe's variants), against
ringpipe's 1F1B in the same block (same data, same number of optimizer steps: one per batch).

    python benchmarks/pipeline_gpt2_vs_torch.py --steps 20 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import report, stats  # noqa: E402
from lib.pipeline.meters import ActivationMeter  # noqa: E402

__all__ = ["main"]

RINGPIPE = ["gpipe", "1f1b", "zb_h1", "zb_h2", "async_1f1b"]
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def gpt2(args: argparse.Namespace) -> Any:
    """The one model definition both sides build (same seed: same weights)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
                     n_positions=args.seq, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def batches(args: argparse.Namespace, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        out.append((x, (x + 1) % args.vocab))
    return out


def held_out(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch none of the training steps sees (its own seed), for the loss after training."""
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(2))
    return x, (x + 1) % args.vocab


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def held_bytes(params: list[torch.Tensor]) -> int:
    """Parameters and their gradients (SGD without momentum keeps no optimizer state)."""
    return 2 * sum(p.numel() * p.element_size() for p in params)


def ringpipe_variant(comm: Any, args: argparse.Namespace, schedule: str, data: list) -> dict[str, Any]:
    from ringpipe.pipeline import PipelineTrainer

    is_async = schedule == "async_1f1b"
    t = PipelineTrainer(comm, gpt2(args), schedule=schedule, microbatches=args.microbatches,
                        split_points=[args.split], sample=data[0][0][:2], loss_fn=lm_loss,
                        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=args.lr),
                        step_every=args.microbatches if is_async else 1)
    params = [p for r in t.runtimes for p in r.module.parameters()]
    meter = ActivationMeter(params)
    import ringpipe.pipeline.stage as stage_mod

    orig = getattr(stage_mod, "live_weights", None)
    if orig is not None:
        stage_mod.live_weights = meter.nested(orig)  # type: ignore[assignment]

    def step(x: Any, y: Any) -> float | None:
        feed = (x if t.is_first else None, y if t.is_last else None)
        return t.stream_step(*feed) if is_async else t.train_step(*feed)

    def evaluate() -> float | None:
        x, y = held_out(args)
        return t.eval_step(x if t.is_first else None, y if t.is_last else None)[0]

    try:
        with meter.hooks():
            return timed_steps(comm, args, data, step, t.drain, meter, held_bytes(params), evaluate)
    finally:
        if orig is not None:
            stage_mod.live_weights = orig  # type: ignore[assignment]


def torch_variant(comm: Any, args: argparse.Namespace, schedule: str, data: list) -> dict[str, Any]:
    import torch.distributed.pipelining as pp

    mb = args.batch // args.microbatches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pp.pipeline(gpt2(args), mb_args=(data[0][0][:mb],),
                           split_spec={args.split: pp.SplitPoint.BEGINNING})
    stage = pipe.build_stage(comm.rank, torch.device("cpu"), group=dist.group.WORLD)
    sched = getattr(pp, TORCH[schedule])(stage, args.microbatches, loss_fn=lm_loss)
    params = list(stage.submod.parameters())
    opt = torch.optim.SGD(params, lr=args.lr)
    meter = ActivationMeter(params)
    first, last = comm.rank == 0, comm.rank == comm.size - 1

    def step(x: Any, y: Any) -> float | None:
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if last:
            sched.step(target=y, losses=losses)
        else:
            sched.step(*((x,) if first else ()))
        opt.step()
        return float(torch.stack(losses).mean()) if last else None

    with meter.hooks():
        return timed_steps(comm, args, data, step, lambda: None, meter, held_bytes(params))


def timed_steps(comm: Any, args: argparse.Namespace, data: list, step: Any, drain: Any,
                meter: ActivationMeter, held: int, evaluate: Any = None) -> dict[str, Any]:
    for x, y in data[: args.warmup]:
        step(x, y)
    drain()
    meter.peak = 0
    comm.barrier()
    t0 = time.perf_counter()
    losses = [step(x, y) for x, y in data[args.warmup:]]
    drain()
    comm.barrier()
    dt = time.perf_counter() - t0
    tail = [v for v in losses[-max(1, args.steps // 4):] if v is not None]
    return {"samples_per_s": args.steps * args.batch / dt, "peak_mib": (held + meter.peak) / 2**20,
            "params_mib": held / 2 / 2**20, "loss_tail": statistics.mean(tail) if tail else None,
            "loss_after": evaluate() if evaluate is not None else None}


def worker(comm: Any, args: argparse.Namespace, names: list[str]) -> dict[str, list[dict]]:
    torch.set_num_threads(1)
    data = batches(args, args.warmup + args.steps)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for block in range(args.repeats):
        k = block % len(names)
        for n in names[k:] + names[:k]:
            system, sched = n.split()
            run = ringpipe_variant if system == "ringpipe" else torch_variant
            out[n].append(run(comm, args, sched, data))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--split", help="where stage 1 begins (default: transformer.h.{layers // 2})")
    ap.add_argument("--only", help="comma-separated variants, e.g. 'ringpipe 1f1b,torch 1f1b'")
    ap.add_argument("--quick", action="store_true", help="seconds: a tiny GPT-2, 2 steps, one block, both 1f1b and the asynchronous one")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.vocab, args.seq, args.batch, args.microbatches = 2, 32, 64, 8, 8, 4
        args.steps, args.warmup, args.repeats = 2, 1, 1
        args.only = args.only or "ringpipe 1f1b,torch 1f1b,ringpipe async_1f1b"
    args.split = args.split or f"transformer.h.{args.layers // 2}"
    known = [f"ringpipe {s}" for s in RINGPIPE] + [f"torch {s}" for s in TORCH]
    names = [v.strip() for v in args.only.split(",")] if args.only else known
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"--only: unknown variants {unknown}; valid: {known}")
    if args.batch % args.microbatches:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    report.header("pipeline_gpt2_vs_torch", argv)
    load_before = os.getloadavg()[0]
    from ringpipe.launch import spawn

    r0, r1 = spawn(worker, 2, args=(args, names), env={"OMP_NUM_THREADS": "1"})
    print(f"\n# GPT-2: {args.layers} blocks, width {args.width}, {args.heads} heads, vocab {args.vocab}, "
          f"sequence {args.seq}; split at {args.split}; batch {args.batch}, {args.microbatches} micro-batches, "
          f"SGD lr {args.lr}; {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} blocks; "
          f"2 processes x 1 thread over gloo; load average before {load_before:.2f}\n")
    rows = []
    med = {}
    for n in names:
        xs = [r["samples_per_s"] for r in r0[n]]
        med[n] = stats.median(xs)
        losses = [r["loss_tail"] for r in r1[n] if r["loss_tail"] is not None]
        after = [r["loss_after"] for r in r1[n] if r["loss_after"] is not None]
        rows.append([n, f"{med[n]:.1f}", f"{min(xs):.1f}-{max(xs):.1f}",
                     f"{stats.median([r['peak_mib'] for r in r0[n]]):.2f} / {stats.median([r['peak_mib'] for r in r1[n]]):.2f}",
                     f"{r0[n][0]['params_mib']:.2f} / {r1[n][0]['params_mib']:.2f}",
                     f"{stats.median(losses):.4f}" if losses else "n/a",
                     f"{stats.median(after):.4f}" if after else "n/a"])
    total_steps = args.warmup + args.steps
    print(report.table(["variant", "samples/s (median)", "spread (min-max)", "peak MiB rank 0 / 1",
                        "parameters MiB rank 0 / 1", "loss, last quarter of the steps",
                        f"held-out loss after {total_steps} steps"], rows,
                       [False, True, False, True, True, True, True]))

    def per_block(a: str, b: str) -> stats.Spread:
        return stats.ratios([x["samples_per_s"] for x in r0[a]], [y["samples_per_s"] for y in r0[b]])

    print("\nSpeed ratios below (samples/s, above 1 is faster); the headline's are times (below 1 is faster).")
    headline: list[tuple[str, str, stats.Spread]] = []
    sync_r = [n for n in names if n.startswith("ringpipe") and "async" not in n]
    sync_t = [n for n in names if n.startswith("torch")]
    if sync_r and sync_t:
        best_r, best_t = max(sync_r, key=med.__getitem__), max(sync_t, key=med.__getitem__)
        s = per_block(best_r, best_t)
        print(f"- best synchronous, speed: {best_r} / {best_t} = {s.fmt()}")
        headline.append((f"GPT-2 pipeline step time, {best_r} (best synchronous)", best_t, per_block(best_t, best_r)))
        for sched in TORCH:
            if f"ringpipe {sched}" in names and f"torch {sched}" in names:
                print(f"- same schedule, speed: ringpipe {sched} / torch {sched} = "
                      f"{per_block(f'ringpipe {sched}', f'torch {sched}').fmt()}")
    if "ringpipe async_1f1b" in names and "ringpipe 1f1b" in names:
        s = per_block("ringpipe async_1f1b", "ringpipe 1f1b")
        print(f"- asynchronous against 1F1B, speed: {s.fmt()}")
        a_loss = stats.median([r["loss_after"] for r in r1["ringpipe async_1f1b"]])
        s_loss = stats.median([r["loss_after"] for r in r1["ringpipe 1f1b"]])
        print(f"- asynchronous against 1F1B, held-out loss after {total_steps} steps (same data, one step per "
              f"batch): {a_loss:.4f} against {s_loss:.4f} ({a_loss - s_loss:+.4f}, {100 * (a_loss / s_loss - 1):+.2f} %)")
        headline.append(("GPT-2 pipeline step time, ringpipe async_1f1b", "ringpipe 1f1b",
                         per_block("ringpipe 1f1b", "ringpipe async_1f1b")))
    if headline:
        report.headline(headline)
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
