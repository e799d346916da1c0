"""A pipeline stage's peak memory: predicted before the run against measured during it, per mode and stage.

    python benchmarks/pipeline_memory.py                  # MLP and transformer, 2 and 3 stages
    python benchmarks/pipeline_memory.py --quick          # seconds: the MLP on 2 stages

The models are those of ``src/ringpipe/configs/1f1b.yaml`` (the MLP ``[128, 128, 64]`` on 8x8
digits, batch 64, 4 micro-batches) and ``transformer.yaml`` (``d_model=64, heads=4, ff=128,
layers=2`` on sequences of 16 tokens of a vocabulary of 32, batch 32), split uniformly by layer
count, trained with Adam. The prediction is :func:`ringpipe.pipeline.memory_plan.plan_memory`
(what ``ringpipe plan`` prints: one micro-batch's forward per part, counted with saved-tensor
hooks, walked through each schedule's action list); the measurement is
:class:`ringpipe.pipeline.memory.MemoryMeter` on real gloo ranks training three batches (the
unique storages each stage holds after each action: its kept graphs walked, ``p.grad``,
optimizer state, stashes). Bytes are counted exactly on CPU, so the figures do not depend on
the machine's load; the error column is ``predicted / measured - 1``.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import report  # noqa: E402

from ringpipe.launch import spawn  # noqa: E402
from ringpipe.pipeline import PipelineTrainer  # noqa: E402
from ringpipe.pipeline.memory import MemoryMeter, format_bytes  # noqa: E402
from ringpipe.pipeline.memory_plan import plan_memory  # noqa: E402
from ringpipe.train.models import mlp, transformer  # noqa: E402

SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b", "zb_h1": "zb_h1",
            "zb_h2": "zb_h2", "async": "async_1f1b"}
MODELS = {
    "mlp": (SimpleNamespace(hidden=[128, 128, 64], dropout=0.0),
            SimpleNamespace(name="digits", input_shape=(1, 8, 8), num_classes=10, kind="image"), 64),
    "transformer": (SimpleNamespace(d_model=64, heads=4, ff=128, dropout=0.0, layers=2),
                    SimpleNamespace(name="synthetic_lm", input_shape=(16,), num_classes=32, kind="lm"), 32),
}
M = 4


def build(model: str) -> nn.Sequential:
    torch.manual_seed(0)
    cfg, data, _ = MODELS[model]
    return (mlp if model == "mlp" else transformer)(cfg, data)


def batch(model: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if model == "mlp":
        return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
    return torch.randint(0, 32, (n, 16), generator=g), torch.randint(0, 32, (n, 16), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def uniform(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def measure(comm, model: str, modes: list[str]) -> dict[str, dict]:
    out = {}
    for mode in modes:
        layers = build(model)
        chunks = 2 if mode == "interleaved" else None
        extra = {"mitigations": "ws"} if mode == "async" else {}
        t = PipelineTrainer(comm, layers, balance=uniform(len(layers), comm.size * (chunks or 1)),
                            schedule=SCHEDULE[mode], microbatches=M, optimizer_factory=adam, loss_fn=loss_fn,
                            chunks=chunks, **extra)
        meter = MemoryMeter().attach(t.runtimes, t.executor, t.optimizer, t.policy)
        for _ in range(3):
            x, y = batch(model, MODELS[model][2])
            step = t.stream_step if mode == "async" else t.train_step
            step(x if t.is_first else None, y if t.is_last else None)
        t.drain()
        out[mode] = meter.peak.as_dict()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,transformer")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--quick", action="store_true", help="the MLP on 2 stages")
    args = ap.parse_args()
    models = ["mlp"] if args.quick else args.models.split(",")
    stage_counts = [2] if args.quick else [int(s) for s in args.stages.split(",")]
    report.header("pipeline_memory")
    rows, worst = [], 0.0
    for model in models:
        for p in stage_counts:
            layers = build(model)
            x, y = batch(model, MODELS[model][2] // M)
            plans = {pl.mode: pl for pl in plan_memory(layers, p, M, x, y, loss_fn, adam,
                                                       balance=lambda parts, n=len(layers): uniform(n, parts),
                                                       mitigations="ws", modes=list(SCHEDULE))}
            modes = [m for m in SCHEDULE if not plans[m].error]
            got = spawn(measure, p, args=(model, modes), env={"OMP_NUM_THREADS": "1"})
            for mode in modes:
                for s in range(p):
                    pred, meas = plans[mode].stages[s], got[s][mode]
                    err = pred.peak / meas["peak"] - 1
                    worst = max(worst, abs(err))
                    rows.append([model, p, mode, s, format_bytes(pred.peak), format_bytes(meas["peak"]),
                                 f"{100 * err:+.1f}%", f"{pred.in_flight} / {meas['in_flight']}",
                                 format_bytes(pred.activations), format_bytes(meas["activations"]),
                                 format_bytes(meas["stashes"])])
    print(report.table(["model", "stages", "mode", "stage", "predicted peak", "measured peak", "error",
                        "in flight (pred / meas)", "activations pred", "activations meas", "stashes meas"], rows,
                       [False, True, False, True, True, True, True, False, True, True, True]))
    print(f"\nlargest |error|: {100 * worst:.1f}% over {len(rows)} stage peaks")
    report.footer()


if __name__ == "__main__":
    main()
