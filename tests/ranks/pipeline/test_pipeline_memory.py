"""A stage's peak memory predicted before a run agrees with the peak measured during it.

The prediction (:func:`ringpipe.pipeline.memory_plan.plan_memory`, one process, nothing run
but one micro-batch's forward per part and one optimizer step on copies) is compared with what
:class:`ringpipe.pipeline.memory.MemoryMeter` measures on real gloo ranks training the same
model for three batches: the unique storages the stage holds after each action, found by
walking its kept graphs (another route than the prediction's saved-tensor hooks). Every mode
(gpipe, 1f1b, interleaved, zb_h1, zb_h2, async with weight stashing) on the MLP and the
transformer of the trainer's model registry, per stage, within 10 %.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ringpipe.pipeline import PipelineTrainer
from ringpipe.pipeline.memory import MemoryMeter
from ringpipe.pipeline.memory_plan import plan_memory
from ringpipe.train.models import mlp, transformer

IMAGE = SimpleNamespace(name="tiny-images", input_shape=(1, 8, 8), num_classes=10, kind="image")
TOKENS = SimpleNamespace(name="tiny-lm", input_shape=(16,), num_classes=32, kind="lm")
SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b", "zb_h1": "zb_h1",
            "zb_h2": "zb_h2", "async": "async_1f1b"}
BATCH, M = 32, 4


def build(model: str) -> nn.Sequential:
    torch.manual_seed(0)
    if model == "mlp":
        return mlp(SimpleNamespace(hidden=[128, 128, 64], dropout=0.0), IMAGE)
    return transformer(SimpleNamespace(d_model=32, heads=4, ff=64, dropout=0.0, layers=4), TOKENS)


def data(model: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if model == "mlp":
        return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
    return torch.randint(0, 32, (n, 16), generator=g), torch.randint(0, 32, (n, 16), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def uniform(layers: nn.Sequential, parts: int) -> list[int]:
    n = len(layers)
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _measure(comm, runs):
    out = {}
    for model, mode in runs:
        layers = build(model)
        chunks = 2 if mode == "interleaved" else None
        parts = comm.size * (chunks or 1)
        extra = {"mitigations": "ws"} if mode == "async" else {}
        t = PipelineTrainer(comm, layers, balance=uniform(layers, parts), schedule=SCHEDULE[mode], microbatches=M,
                            optimizer_factory=adam, loss_fn=loss_fn, chunks=chunks, **extra)
        meter = MemoryMeter().attach(t.runtimes, t.executor, t.optimizer, t.policy)
        for _ in range(3):
            x, y = data(model, BATCH)
            if mode == "async":
                t.stream_step(x if t.is_first else None, y if t.is_last else None)
            else:
                t.train_step(x if t.is_first else None, y if t.is_last else None)
        if mode == "async":
            t.drain()
        out[(model, mode)] = meter.peak.as_dict()
    return out


def predicted(model: str, stages: int) -> dict[str, list[int]]:
    layers = build(model)
    x, y = data(model, BATCH // M)
    plans = plan_memory(layers, stages, M, x, y, loss_fn, adam, balance=lambda parts: uniform(layers, parts),
                        mitigations="ws", modes=list(SCHEDULE))
    return {p.mode: p.stages for p in plans}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stages", [2])
def test_predicted_peak_per_stage_is_within_ten_percent_of_measured(worlds, stages):
    runs = [(model, mode) for model in ("mlp", "transformer") for mode in SCHEDULE]
    measured = worlds.spawn(_measure, stages, args=(runs,))
    for model in ("mlp", "transformer"):
        plan = predicted(model, stages)
        for mode in SCHEDULE:
            for s in range(stages):
                got, want = measured[s][(model, mode)], plan[mode][s]
                assert want.peak == pytest.approx(got["peak"], rel=0.10), (model, mode, s, want, got)


def llama():
    """A Hugging Face Llama (traced into stages): rotary ``cos``/``sin`` cross the boundary and take no gradient."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                        use_cache=False, tie_word_embeddings=True))


TRACED_MODES = ("gpipe", "zb_h2", "async")


def _measure_traced(comm):
    out = {}
    for mode in TRACED_MODES:
        x, _ = data("transformer", BATCH)
        t = PipelineTrainer(comm, llama(), sample=x, schedule=SCHEDULE[mode], microbatches=M, optimizer_factory=adam,
                            loss_fn=loss_fn, **({"mitigations": "ws"} if mode == "async" else {}))
        meter = MemoryMeter().attach(t.runtimes, t.executor, t.optimizer, t.policy)
        for _ in range(3):
            x, y = data("transformer", BATCH)
            step = t.stream_step if mode == "async" else t.train_step
            step(x if t.is_first else None, y if t.is_last else None)
        if mode == "async":
            t.drain()
        out[mode] = meter.peak.as_dict()
    return out


@pytest.mark.slow  # each trainer traces the model (torch.export, twice): in the e2e run
@pytest.mark.timeout(300)
def test_a_traced_llama_is_predicted_as_measured(worlds):
    """The plan splits the model as the run does (``split=``, :func:`~ringpipe.pipeline.tracing.split_model`); within
    2 %: a received tensor takes a gradient only where it required one on the sending stage, as in the run
    (marking Llama's rotary tables too predicted 9 % more than measured under gpipe on the last stage)."""
    pytest.importorskip("transformers")
    from ringpipe.pipeline.tracing import split_model

    measured = worlds.spawn(_measure_traced, 2)
    model = llama()
    x, y = data("transformer", BATCH // M)
    sample = data("transformer", BATCH)[0]
    plans = plan_memory(None, 2, M, x, y, loss_fn, adam, mitigations="ws", modes=list(TRACED_MODES),
                        split=lambda parts: split_model(model, sample, num_stages=parts).stages)
    for plan in plans:
        assert not plan.error, plan
        for s in range(2):
            got, want = measured[s][plan.mode], plan.stages[s]
            assert want.peak == pytest.approx(got["peak"], rel=0.02), (plan.mode, s, want, got)
