"""``ringpipe train`` on Hugging Face models: a GPT-2 factory in mode single and 1f1b split by name; BERT's mapping batches.

The factory (``examples/hf_models.py:gpt2``) returns a ``GPT2LMHeadModel``, whose output is a
``ModelOutput`` and whose LM head is tied to its token embedding. Mode ``single`` is the
reference (a plain torch loop); ``1f1b`` on 2 ranks, cut at ``transformer.h.2``, and ``dp`` on 2
ranks must give the same loss at every logged step (dropout 0, so neither the split nor the
sharding changes the random masks).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainrun import sets, train

transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
BASE = ["epochs=1", "batch_size=16", "max_steps=4", "log_every=1", "optimizer.scale_lr=false",
        "schedule.name=constant", "optimizer.lr=0.01", "model.name=hf_models:gpt2", "model.width=32",
        "model.dropout=0.0", "data.name=synthetic_lm", "data.seq_len=8", "data.samples=256"]


def _losses(records):
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.mark.timeout(300)
def test_gpt2_factory_trains_alike_in_single_1f1b_split_and_dp(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))
    rc, ref, ref_metrics = train(tmp_path / "single", *sets([*BASE, "mode=single"]))
    assert rc == 0, capsys.readouterr().err
    split = [*BASE, "mode=1f1b", "nprocs=2", "pipeline.microbatches=4", "pipeline.split_points=[transformer.h.2]"]
    rc, summary, metrics = train(tmp_path / "1f1b", *sets(split))
    assert rc == 0, capsys.readouterr().err
    assert summary["world_size"] == 2 and summary["steps"] == ref["steps"] == 4
    assert _losses(metrics) == pytest.approx(_losses(ref_metrics), rel=1e-4, abs=1e-5)
    assert summary["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-4, abs=1e-5)
    # each traced stage's memory, predicted as the run splits the model and measured during it; `ringpipe
    # plan` on the same config predicts the same peaks before the run
    per_rank = summary["memory"]["per_rank"]
    assert [r["stage"] for r in per_rank] == [0, 1]
    assert all(r["predicted"] and abs(r["error"]) <= 0.10 for r in per_rank), per_rank
    plan = subprocess.run([sys.executable, "-m", "ringpipe.cli", "plan", *sets(split), "--json"], capture_output=True,
                          text=True, timeout=200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert plan.returncode == 0, plan.stderr[-3000:]
    planned = {p["mode"]: p for p in json.loads(plan.stdout)["plans"]}
    assert [s["peak"] for s in planned["1f1b"]["stages"]] == [r["predicted"]["peak"] for r in per_rank]
    assert not any(p["error"] for p in planned.values()), planned
    # data parallel on 2 ranks, 8 samples each: the same global batches of 16 as single
    rc, summary, metrics = train(tmp_path / "dp", *sets([*BASE, "mode=dp", "nprocs=2", "batch_size=8"]))
    assert rc == 0, capsys.readouterr().err
    assert summary["global_batch"] == 16 and summary["steps"] == ref["steps"]
    assert _losses(metrics) == pytest.approx(_losses(ref_metrics), rel=1e-4, abs=1e-5)
    # async with the tied embedding and LM head on two stages (the stream stays open across batches: the
    # embedding's stage owns the weight, the LM head's keeps a mirror; see docs/pipelines.md)
    rc, summary, metrics = train(tmp_path / "async", *sets([*BASE, "mode=async", "nprocs=2", "pipeline.microbatches=4",
                                                            "pipeline.mitigations=wp+ws"]))
    assert rc == 0, capsys.readouterr().err
    assert summary["steps"] == 4 and all(math.isfinite(v) for v in _losses(metrics))


class _Tokens:
    """A map-style dataset of ({input_ids, attention_mask}, label) items, as a tokenizer gives them."""

    def __init__(self, n=24, seq=8, vocab=50):
        g = torch.Generator().manual_seed(4)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.mask = torch.ones(n, seq, dtype=torch.long)
        for i, k in enumerate(torch.randint(3, seq + 1, (n,), generator=g).tolist()):
            self.mask[i, k:] = 0
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}, int(self.y[i])


@pytest.mark.timeout(300)
def test_bert_with_mapping_batches_in_mode_single(tmp_path):
    """A dataset of mapping inputs collates to keyword arguments; the ModelOutput's logits meet the loss."""
    import ringpipe.train as rt

    def make():
        torch.manual_seed(0)
        cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=50, max_position_embeddings=16, num_labels=3,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
        return transformers.BertForSequenceClassification(cfg)

    data = _Tokens()
    model = make()
    rt.fit(model, data, data, loss=torch.nn.functional.cross_entropy,
           optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
           config={"mode": "single", "epochs": 3, "batch_size": len(data), "log_every": 1, "seed": 0,
                   "optimizer": {"lr": 0.1, "scale_lr": False}, "schedule": {"name": "constant"}},
           run_dir=tmp_path / "run")
    ref = make()  # the plain loop: full-batch steps (the sampler's order does not change a full batch's mean)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        out = ref(input_ids=data.ids, attention_mask=data.mask)
        torch.nn.functional.cross_entropy(out.logits, data.y).backward()
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
