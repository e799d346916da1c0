"""Staleness mitigation benchmark: accuracy and throughput of the asynchronous pipeline per mitigation.

Accuracy: runs the single-process simulator (:mod:`ringpipe.pipeline.simulator`) of an
asynchronous PipeDream pipeline (no flush, one step per micro-batch, stage ``i`` of ``N`` has
staleness ``N-1-i``) on two tasks, with fixed seeds and epochs, and compares each mitigation
with the synchronous reference (the same micro-batches, gradient accumulation, no staleness:
the numbers of a flushing 1F1B or GPipe schedule). The simulator calls the same policy objects
as the multi-process pipeline, which is tested against a reference written from the papers.

Throughput (``--throughput``): one epoch of each mode on real processes (one per stage, gloo),
``PipelineTrainer`` with schedule ``async`` (one stream, no flush, one optimizer step per
micro-batch, as in the accuracy runs) for the mitigations, and two synchronous runs: ``sync``,
the accuracy reference's own algorithm (one step per micro-batch: 1F1B on batches of one
micro-batch, the pipeline drained between steps), and ``sync/batched`` (schedule ``1f1b`` on
batches of ``--batch-microbatches`` micro-batches: one step per batch, a different optimizer
trajectory and a fraction of the steps, so not the algorithm whose accuracy is shown).
Samples per second of the whole epoch, timed on the first stage between two barriers; the
modes run in blocks (``--throughput-repeats``, order rotated per block) and the median and
the range over blocks are reported.


- ``digits``: the 8x8 handwritten digits ringpipe ships, a 4-stage MLP;
- ``deep``: a synthetic 8-class task labelled by a random teacher network, an 8-stage MLP
  (staleness up to 7).

Each epoch is one stream of micro-batches (the pipeline drains at the epoch's end); the
policies (and Gap Aware statistics) persist across epochs. Usage::

    python benchmarks/staleness.py --plot out/staleness.png --json out/staleness.json [--throughput]
    python benchmarks/staleness.py --quick      # seconds: one epoch, sync and stale, digits' throughput once
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import report  # noqa: E402

from ringpipe.pipeline.simulator import simulate_async, simulate_sync  # noqa: E402
from ringpipe.pipeline.staleness import make_policy  # noqa: E402

__all__ = ["MODES", "Task", "digits_task", "deep_task", "run_mode", "main"]

log = logging.getLogger("ringpipe.benchmarks.staleness")

MODES: dict[str, tuple[str, bool]] = {
    "sync": ("", False),
    "stale": ("stale", False),
    "ws": ("ws", False),
    "wp": ("wp", False),
    "wp+ws": ("wp+ws", False),
    "ws+ga": ("ws+ga", False),
    "wp+ws+ga": ("wp+ws+ga", False),
    "ga_jfl": ("ws+ga_jfl", True),
}
"""Row name -> (mitigation names, recompute). ``sync`` is the synchronous reference (1F1B with flush)."""


@dataclass
class Task:
    """A dataset split and a way to build the stages of the model."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    build: Callable[[], list[nn.Module]]
    epochs: int
    lr: float
    microbatch: int = 32


def _mlp_stages(
    widths: list[int], stages: int, seed: int, act: Callable[[], nn.Module] = nn.ReLU
) -> list[nn.Module]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(act())
    per = len(layers) / stages
    bounds = [round(per * s) for s in range(stages + 1)]
    return [nn.Sequential(*layers[bounds[s]:bounds[s + 1]]) for s in range(stages)]


def digits_task(seed: int, epochs: int, lr: float) -> Task:
    """8x8 digits (1,797 images), 75/25 split, a 4-stage MLP 64-128-128-64-10."""
    from ringpipe.train.datasets import digits_arrays

    images, labels = digits_arrays()
    x = torch.from_numpy(images.reshape(len(images), 64)) / 16.0
    y = torch.from_numpy(labels)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    cut = int(0.75 * len(x))
    return Task("digits", x[:cut], y[:cut], x[cut:], y[cut:],
                lambda: _mlp_stages([64, 128, 128, 64, 10], 4, seed), epochs, lr)


def deep_task(seed: int, epochs: int, lr: float) -> Task:
    """Synthetic: 32-d Gaussian inputs labelled by a random teacher; an 8-stage tanh MLP (9 layers)."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2560, 32, generator=gen)
    teacher = [torch.randn(32, 32, generator=gen) / 32**0.5 for _ in range(2)]
    head = torch.randn(32, 8, generator=gen)
    h = x
    for w in teacher:
        h = torch.tanh(h @ w) * 2
    y = (h @ head).argmax(dim=1)
    widths = [32] + [64] * 8 + [8]
    return Task("deep", x[:2048], y[:2048], x[2048:], y[2048:],
                lambda: _mlp_stages(widths, 8, seed, nn.Tanh), epochs, lr)


def _evaluate(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = x
        for s in stages:
            out = s(out)
        return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def run_mode(task: Task, mode: str, seed: int) -> dict[str, Any]:
    """Train one mode; per-epoch train loss, test loss and test accuracy."""
    names, recompute = MODES[mode]
    stages = task.build()
    opts = [torch.optim.SGD(s.parameters(), lr=task.lr, momentum=0.9) for s in stages]
    n = len(stages)
    policies = None
    if mode != "sync":
        policies = [make_policy(names, list(s.parameters()), o, stage=i, num_stages=n, recompute=recompute)
                    for i, (s, o) in enumerate(zip(stages, opts, strict=True))]
    gen = torch.Generator().manual_seed(seed + 7)
    curve: dict[str, list[float]] = {"train_loss": [], "test_loss": [], "test_acc": []}
    start = time.perf_counter()
    for _ in range(task.epochs):
        perm = torch.randperm(len(task.x_train), generator=gen)
        mbs = [(task.x_train[perm[i:i + task.microbatch]], task.y_train[perm[i:i + task.microbatch]])
               for i in range(0, len(perm), task.microbatch)]
        if policies is None:
            res = simulate_sync(stages, opts, nn.functional.cross_entropy, mbs)
        else:
            res = simulate_async(stages, opts, nn.functional.cross_entropy, mbs,
                                 recompute=recompute, policies=policies)
        curve["train_loss"].append(sum(res.losses) / len(res.losses))
        loss, acc = _evaluate(stages, task.x_test, task.y_test)
        curve["test_loss"].append(loss)
        curve["test_acc"].append(acc)
    curve["seconds"] = time.perf_counter() - start  # type: ignore[assignment]
    return curve


def _throughput_rank(comm: Any, task: Task, mode: str, batch_micro: int) -> float | None:
    from ringpipe.pipeline import PipelineTrainer

    if mode == "sync":
        batch_micro = 1  # one step per micro-batch, like the accuracy reference
    mode = "sync" if mode == "sync/batched" else mode
    names, recompute = MODES[mode]
    layers = [m for stage in task.build() for m in stage]
    balance = [len(stage) for stage in task.build()]
    t = PipelineTrainer(
        comm, layers, balance=balance, schedule="1f1b" if mode == "sync" else "async",
        microbatches=batch_micro, recompute=recompute, mitigations=None if mode == "sync" else names,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=task.lr, momentum=0.9),
        loss_fn=nn.functional.cross_entropy,
    )
    per_batch = task.microbatch * batch_micro
    count = len(task.x_train) // per_batch
    batches = [(task.x_train[b * per_batch:(b + 1) * per_batch], task.y_train[b * per_batch:(b + 1) * per_batch])
               for b in range(count)]
    feed = [(x if t.is_first else None, y if t.is_last else None) for x, y in batches]
    t.train_stream(feed[:1], 1)  # warm-up: first messages, allocations
    comm.barrier()
    start = time.perf_counter()
    t.train_stream(feed, count)
    comm.barrier()
    seconds = time.perf_counter() - start
    return count * per_batch / seconds if comm.rank == 0 else None


def throughput(task: Task, mode: str, batch_micro: int) -> float:
    """Samples per second of one epoch of ``mode`` on real processes, one per stage."""
    from ringpipe.launch import spawn

    stages = len(task.build())
    return float(spawn(_throughput_rank, stages, args=(task, mode, batch_micro))[0])


def _plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    for col, (task, rows) in enumerate(results.items()):
        for mode, curve in rows.items():
            if "train_loss" not in curve:  # a throughput-only row (sync/batched)
                continue
            style = "k-" if mode == "sync" else "-"
            axes[0][col].plot(range(1, len(curve["train_loss"]) + 1), curve["train_loss"], style, label=mode)
            axes[1][col].plot(range(1, len(curve["test_acc"]) + 1), curve["test_acc"], style, label=mode)
        axes[0][col].set(title=f"{task}: train loss", xlabel="epoch", yscale="log")
        axes[1][col].set(title=f"{task}: test accuracy", xlabel="epoch")
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits-epochs", type=int, default=20)
    parser.add_argument("--digits-lr", type=float, default=0.03)
    parser.add_argument("--deep-epochs", type=int, default=15)
    parser.add_argument("--deep-lr", type=float, default=0.03)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--throughput", action="store_true",
                        help="also time one epoch of each mode on real processes (one per stage)")
    parser.add_argument("--batch-microbatches", type=int, default=8,
                        help="micro-batches per batch of sync/batched when timing (default 8)")
    parser.add_argument("--throughput-repeats", type=int, default=3,
                        help="blocks of throughput runs (every mode once per block); median and range reported")
    parser.add_argument("--plot", type=Path, help="write a PNG of the loss and accuracy curves here")
    parser.add_argument("--json", type=Path, help="write all curves and the table as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="seconds: one epoch of each task, modes sync and stale, throughput of digits once")
    args = parser.parse_args(argv)
    report.header("staleness", argv)
    if args.quick:
        args.digits_epochs, args.deep_epochs, args.modes = 1, 1, "sync,stale"
        args.throughput, args.throughput_repeats, args.batch_microbatches = True, 1, 2
    torch.set_num_threads(1)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown mode(s) {bad}; valid: {', '.join(MODES)}")
    tasks = [digits_task(args.seed, args.digits_epochs, args.digits_lr),
             deep_task(args.seed, args.deep_epochs, args.deep_lr)]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for task in tasks:
        results[task.name] = {m: run_mode(task, m, args.seed) for m in modes}
        if args.throughput and not (args.quick and task.name != "digits"):  # --quick: 4 processes, not 8
            timed = modes + (["sync/batched"] if "sync" in modes else [])
            runs: dict[str, list[float]] = {m: [] for m in timed}
            for block in range(args.throughput_repeats):
                k = block % len(timed)
                for m in timed[k:] + timed[:k]:  # rotated: drift of the shared machine falls on every mode
                    runs[m].append(throughput(task, m, args.batch_microbatches))
            for m, v in runs.items():
                row = results[task.name].setdefault(m, {})
                row["samples_per_s"], row["samples_per_s_range"] = statistics.median(v), (min(v), max(v))
    columns = ["mode"] + [f"{t.name} {what}" for t in tasks for what in ("acc", "loss", "vs sync", "samples/s")]
    cells = []
    for m in modes:
        row = [m]
        for t in tasks:
            c = results[t.name][m]
            ref = results[t.name].get("sync", c)["test_acc"][-1]
            row += [f"{c['test_acc'][-1] * 100:.2f}%", f"{c['test_loss'][-1]:.4f}", f"{c['test_acc'][-1] / ref:.3f}",
                    f"{c.get('samples_per_s', float('nan')):.0f}"]
        cells.append(row)
    lines = [report.table(columns, cells, [False] + [True] * (len(columns) - 1))]
    if args.throughput:
        lines.append("samples/s: median over blocks; range " + "; ".join(
            f"{t.name} {m} {lo:.0f}-{hi:.0f}" for t in tasks for m, c in results[t.name].items()
            for lo, hi in [c.get("samples_per_s_range", (float("nan"),) * 2)]))
        if "sync" in modes:
            lines.append("sync/batched (one step per batch of {} micro-batches, not the accuracy reference): {}".format(
                args.batch_microbatches, ", ".join(
                    f"{t.name} {results[t.name]['sync/batched']['samples_per_s']:.0f}" for t in tasks
                    if "sync/batched" in results[t.name])))
    table = "\n".join(lines)
    print(table)  # noqa: T201 -- a benchmark script reports on stdout
    report.footer()
    out = {"config": vars(args) | {"plot": str(args.plot), "json": str(args.json)},
           "table": table, "results": results}
    if args.plot:
        _plot(results, args.plot)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
